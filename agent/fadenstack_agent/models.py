"""``model place|list|remove|download`` and ``hub check``: models in the store.

A model's files are blobs like any other (``blob fetch`` brings them from the
server or another machine); ``model place`` lays them out as the tree an
engine reads (``modelstore``).  On a cluster whose machines download models
themselves, ``model download`` brings the missing files from the Hugging Face
Hub first (``hubfetch``), then places the model the same way; ``hub check``
tells whether this machine reaches the hub at all.

Specs come on stdin as JSON, the hub token among them: it never shows on a
command line, in a log line, an error, a progress event or a file.
"""

import json

from .blobspec import read_spec
from .cli import STORE, arg, command, group, seconds_arg
from .files import free_bytes, store_dir
from .hubfetch import Download, check_url, hub_check, scrub
from .modelstore import (check_model, check_repo, check_revision, missing_blobs, models_lock, place, read_manifests,
                         remove, summary)
from .protocol import BAD_INPUT, NOT_RETRYABLE, RETRYABLE, AgentError

MODEL_SHAPE = '{"repo": "org/name", "revision": "...", "files": [{"path", "digest", "size"}]}'
DOWNLOAD_SHAPE = ('{"endpoint": "https://huggingface.co", "repo": "org/name", "revision": "...", '
                  '"files": [{"path", "digest", "size"}], "token": "optional"}')

group("model", help="models placed in the store (trees of hard links to blobs)")
group("hub", help="the Hugging Face Hub as this machine reaches it")

REPO = arg("--repo", required=True, metavar="ORG/NAME", help="the model's repo id on the hub")
REVISION = arg("--revision", required=True, metavar="REV", help="the revision placed (commit sha, branch or tag)")


def read_model_spec(shape: str) -> dict:
    """The JSON object on stdin, or ``bad_input`` saying which shape it must have."""
    try:
        raw = read_spec(noun="model")
    except AgentError:
        raise AgentError(BAD_INPUT, "no model spec arrived on stdin: send one JSON object %s" % shape)
    try:
        spec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise AgentError(BAD_INPUT, "the model spec on stdin is not valid JSON: %s" % exc)
    if not isinstance(spec, dict):
        raise AgentError(BAD_INPUT, "the model spec on stdin must be one JSON object %s" % shape)
    return spec


def check_token(token):
    """The hub token from the spec, or None; its value never goes into a message."""
    if token is None or token == "":
        return None
    if not isinstance(token, str) or len(token) > 8192 or any(c.isspace() or ord(c) < 32 for c in token):
        raise AgentError(BAD_INPUT, "the spec's \"token\" must be a string without spaces or control characters")
    return token


def _unique(files: list) -> list:
    """One entry per digest (a repo may hold the same bytes under two names)."""
    seen, unique = set(), []
    for f in files:
        if f["digest"] not in seen:
            seen.add(f["digest"])
            unique.append(f)
    return unique


# ------------------------------------------------------------------ commands


@command("model", "place", args=[STORE])
def cmd_place(args, out) -> int:
    """``model place [--store PATH]``: lay out a model's blobs as its file tree.

    Stdin: ``{"repo", "revision", "files": [{"path", "digest", "size"}]}``.
    Every file must be a complete blob of its size in the store (else
    ``not_retryable`` naming the missing ones).  Makes
    ``<store>/models/<org>--<name>/<revision>/<path>`` as hard links to the
    blobs, then writes the model's manifest in one step, last: a model placed
    halfway does not count.  Idempotent; placing other files under the same
    revision replaces the old ones.  An unsafe repo id, revision or path
    (absolute, ``..``, NUL, too long) is ``bad_input``.  Result: ``{"repo",
    "revision", "path", "bytes", "files", "placed_at"}`` (``files``: how many).
    """
    model = check_model(read_model_spec(MODEL_SHAPE))
    store = store_dir(args.store)
    with models_lock(store):
        return out.result(**place(store, model))


@command("model", "list", args=[STORE])
def cmd_list(args, out) -> int:
    """``model list [--store PATH]``: the placed models, from their manifests.

    Result: ``{"store", "free_bytes", "models": [{"repo", "revision", "path",
    "bytes", "files", "placed_at"}]}``; a model whose manifest is not written
    yet (being placed) is not listed.
    """
    store = store_dir(args.store)
    models = [summary(store, manifest) for manifest in read_manifests(store)]
    return out.result(store=store, free_bytes=free_bytes(store), models=models)


@command("model", "remove", args=[STORE, REPO, REVISION])
def cmd_remove(args, out) -> int:
    """``model remove --repo R --revision V [--store PATH]``: remove a model and the blobs only it uses.

    The manifest goes first, then the tree, then the blobs it lists that no
    other manifest lists (the blob directory also holds runtime images and
    files on their way: nothing else is touched).  An unknown model is no
    error.  Result: ``{"repo", "revision", "freed"}`` (bytes that left the disk).
    """
    repo, revision = check_repo(args.repo), check_revision(args.revision)
    store = store_dir(args.store)
    with models_lock(store):
        freed = remove(store, repo, revision)
    return out.result(repo=repo, revision=revision, freed=freed)


@command("model", "download", args=[STORE])
def cmd_download(args, out) -> int:
    """``model download [--store PATH]``: download a model from the hub, then place it.

    Stdin: ``{"endpoint", "repo", "revision", "files", "token"}``.  Downloads each file that is not a complete blob from
    ``{endpoint}/{repo}/resolve/{revision}/{path}`` into
    ``<store>/blobs/<digest>.part`` (resumed with a Range request from what
    it holds), checks each whole file's sha256 (a mismatch is removed,
    ``not_retryable``), then places the model as ``model place`` does.
    Room check first for all missing bytes (``no_room``, nothing written).
    Redirects are followed; the token (optional, for gated models) goes
    only to the endpoint's own host.  401/403/404 are ``not_retryable`` in
    words; a hub that does not answer is ``unreachable``.  Progress, at most
    every 0.25 s: ``{"event": "progress", "digest", "file", "bytes", "total",
    "rate"}``.  Result: ``model place``'s, plus ``{"files_downloaded",
    "bytes_downloaded", "resumed_bytes", "seconds", "rate"}``.
    """
    spec = read_model_spec(DOWNLOAD_SHAPE)
    token = check_token(spec.get("token"))
    try:
        return _download(args, out, spec, token)
    except AgentError as exc:
        raise AgentError(exc.kind, scrub(exc.message, token))
    except Exception as exc:  # noqa: BLE001 - __main__ would print it, and it might quote the token
        raise AgentError(RETRYABLE, scrub("%s: %s" % (type(exc).__name__, exc), token))


def _download(args, out, spec: dict, token) -> int:
    model = check_model(spec)
    endpoint = check_url(spec.get("endpoint"), "the spec's \"endpoint\"")
    store = store_dir(args.store)
    missing = _unique(missing_blobs(store, model["files"]))
    download = Download(dict(model, endpoint=endpoint, token=token), store, out)
    counts = download.run(missing)
    with models_lock(store):
        try:
            placed = place(store, model)
        except AgentError as exc:
            if exc.kind != NOT_RETRYABLE or not missing_blobs(store, model["files"]):
                raise
            raise AgentError(RETRYABLE, "a file of %s left the store while it was downloaded (a model removed "
                                        "meanwhile?); download it again" % model["repo"])
    return out.result(**dict(placed, **counts))


@command("hub", "check", args=[
    arg("--url", required=True, metavar="URL", help="the hub's address (https://huggingface.co, HF_ENDPOINT)"),
    arg("--timeout", type=seconds_arg(0.1, 300), default=5.0, help="seconds to wait (default 5)")])
def cmd_hub_check(args, out) -> int:
    """``hub check --url URL [--timeout S]``: one real GET of ``{url}/api/models?limit=1``.

    Result: ``{"ok": true, "status": 200, "seconds"}``.  Anything else is
    ``unreachable``, saying why in words: connection refused, no route to
    host, timed out after 5 s, the name does not resolve, HTTP status N.
    """
    return out.result(**hub_check(check_url(args.url, "--url"), args.timeout))
