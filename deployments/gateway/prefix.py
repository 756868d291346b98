"""Cache-aware routing: which copy served a prompt's prefix lately, so that a prompt that starts the same way
goes to the copy whose engine still holds that prefix in its KV cache (and skips computing it again).

A prompt is read as text (``prompt_text``: a chat's messages, each role and content, or a completion's prompt)
and cut into blocks of ``block`` characters; each block's key is the hash of the key before it and the block
(a chain, as vLLM keys its KV-cache blocks; the first starts from the deployment's id), so one key stands for
the whole prefix up to the end of its block, in that deployment. Only whole blocks count, and the first
``MAX_BLOCKS`` at most (a longer prompt is known by its first 128 Ki characters).

``PrefixIndex`` maps keys to the copy that last served them, ``entries`` keys at most: a key used again
becomes the newest, and the oldest go when it is full (about 210 bytes a key: bench/prefix_index.py). It
lives in one gateway process, shared with no other: each process learns from the requests it routes.

``CacheAware.choose``: the copy holding the prompt's longest known prefix, among the copies in rotation and
not tried yet, unless it has more than ``bound`` requests in flight above the least busy copy (one hot prefix
cannot overload one copy): then the least busy. Either way the prompt's keys name the chosen copy from then on.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Protocol


class CopyRoute(Protocol):
    """What the choice reads of a copy (routes.CopyRoute has it; routes imports this module, not the reverse)."""

    id: int
    in_flight: int
    out_since: float | None

DEFAULT_ENTRIES = 100_000  # keys kept (FADEN_GATEWAY_PREFIX_ENTRIES)
DEFAULT_BOUND = 8  # requests in flight a holder may have above the least busy copy (FADEN_GATEWAY_PREFIX_BOUND)
DEFAULT_BLOCK = 256  # characters a block (FADEN_GATEWAY_PREFIX_BLOCK): about 64 tokens of English
MAX_BLOCKS = 512  # blocks of a prompt keyed at most


def prompt_text(request: dict) -> str | None:
    """The prompt as one text whose prefix is the prompt's prefix: a chat's messages (role and content, marked
    apart), or a completion's prompt (the first of a batch). None when the request has neither (embeddings)."""
    messages = request.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                parts.append(f"\x1e{message.get('role')}\x1f{content if isinstance(content, str) else _text_of(content)}")
        return "".join(parts)
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):  # a batch of token id lists
            return str(first)
        return str(prompt)  # token ids: "[1, 2, 3, ..." grows at its end as the prompt does
    return None


def _text_of(content) -> str:
    """A message's content that is not a string: its parts' text, other parts (images) as JSON."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part["text"] if isinstance(part, dict) and isinstance(part.get("text"), str)
                       else json.dumps(part, sort_keys=True, default=str) for part in content)
    return json.dumps(content, sort_keys=True, default=str)


def prefix_keys(seed: int, text: str, block: int) -> list[int]:
    """The key of each whole block of ``text``: the hash of the key before it and the block's characters."""
    keys = []
    key = seed
    end = min(len(text) // block, MAX_BLOCKS) * block
    for start in range(0, end, block):
        key = hash((key, text[start:start + block]))
        keys.append(key)
    return keys


class PrefixIndex:
    """Keys of prompts' prefixes -> the id of the copy that last served one, the newest last; ``entries`` at most."""

    def __init__(self, entries: int = DEFAULT_ENTRIES):
        if entries < 1:
            raise ValueError("a prefix index holds at least one key")
        self.entries = entries
        self.copies: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.copies)

    def holders(self, keys: list[int]):
        """The copies that served the prompt's known prefixes, the longest prefix first."""
        get = self.copies.get
        for key in reversed(keys):
            copy = get(key)
            if copy is not None:
                yield copy

    def record(self, keys: list[int], copy_id: int) -> None:
        """The prompt's prefixes were sent to ``copy_id``: their keys name it and are the newest (the shortest
        newest of all: it is the most shared); the oldest keys go past ``entries``."""
        copies = self.copies
        held = copies.get
        newest = copies.move_to_end
        for key in reversed(keys):
            if held(key) != copy_id:  # setting an OrderedDict's item costs more than looking at it
                copies[key] = copy_id
            newest(key)
        for _ in range(len(copies) - self.entries):
            copies.popitem(last=False)


class CacheAware:
    """One process's cache-aware routing: its prefix index and its load bound. ``sent`` counts the requests it
    sent to the copy holding their prefix (``held``), to the least busy while that copy was over the bound
    (``busy``), and those whose prefix no copy in rotation held (``new``)."""

    def __init__(self, *, entries: int = DEFAULT_ENTRIES, bound: int = DEFAULT_BOUND, block: int = DEFAULT_BLOCK):
        self.index = PrefixIndex(entries)
        self.bound = bound
        self.block = block
        self.sent = {"held": 0, "busy": 0, "new": 0}

    def keys(self, deployment_id: int, request: dict) -> list[int] | None:
        """The keys of the request's prompt in that deployment (None or empty: shorter than a block, or no prompt;
        a prompt that cannot be read as text, nested past Python's recursion limit, is routed least busy)."""
        try:
            text = prompt_text(request)
        except (RecursionError, TypeError, ValueError):
            return None
        return prefix_keys(deployment_id, text, self.block) if text else None

    def choose(self, copies: list[CopyRoute], keys: list[int], least: CopyRoute, tried) -> CopyRoute:
        """The copy in rotation (not in ``tried``) that served the longest prefix of the prompt, unless it has more
        than ``bound`` requests in flight above ``least`` (the least busy copy): then ``least``."""
        chosen, why = least, "new"
        for copy_id in self.index.holders(keys):
            holder = next((copy for copy in copies if copy.id == copy_id), None)
            if holder is None or holder.out_since is not None or holder.id in tried:
                continue  # gone, out of rotation, or refused this request: a shorter prefix's copy may do
            if holder.in_flight <= least.in_flight + self.bound:
                chosen, why = holder, "held"
            else:
                why = "busy"
            break
        self.sent[why] += 1
        self.index.record(keys, chosen.id)
        return chosen
