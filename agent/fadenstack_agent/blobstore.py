"""Content-addressed files ("blobs") in the store, of any kind: runtime images
today, model files next.  Shared by ``blob`` / ``image`` and the blob server.

Under ``<store>/blobs/``: ``<sha256>`` (a finished, digest-checked file), or
``<sha256>.part`` plus ``<sha256>.state.json`` while it arrives.  The state
file says how many leading chunks of the ``.part`` are verified (their sha256
matched); it is replaced in one step after each chunk, so a reader (the
server forwarding the file while it arrives) never sees half of it.

Agents before 0.2 kept runtime images as ``<store>/images/<sha256>.img``;
``adopt_old_images`` moves them here, so an upgraded machine keeps them.
"""

import fcntl
import hashlib
import json
import os
import re

from .files import blobs_dir, read_json, remove_quietly, replace_quickly
from .protocol import BAD_INPUT, AgentError

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
PART, STATE = ".part", ".state.json"
OLD_DIR, OLD_COMPLETE = "images", ".img"


def check_digest(text, what="--digest") -> str:
    """A sha256 hex digest (64 hex digits), lower-cased; bad_input otherwise."""
    value = text.strip().lower() if isinstance(text, str) else text
    if not isinstance(value, str) or not DIGEST_RE.match(value):
        raise AgentError(BAD_INPUT, "%s must be a sha256 as 64 hex digits, got %r"
                         % (what, text if not isinstance(text, str) else text[:80]))
    return value


class BlobFiles:
    """The file names of one blob in one store."""

    def __init__(self, store: str, digest: str):
        self.store = store
        self.digest = digest
        self.dir = blobs_dir(store)
        self.path = os.path.join(self.dir, digest)
        self.part = self.path + PART
        self.state = self.path + STATE


def write_state(files: BlobFiles, state: dict) -> None:
    """Replace the state file in one step (no fsync: the ``.part`` is fsynced
    at the end, and a resume hashes again the chunks it trusts)."""
    replace_quickly(files.state, json.dumps(state, separators=(",", ":")).encode("utf-8"))


def state_verified_bytes(state, digest: str):
    """(size, verified bytes) from a state dict, or None when it does not fit."""
    try:
        if state.get("digest") != digest:
            return None
        size, chunk, done = int(state["size"]), int(state["chunk_size"]), int(state["verified_chunks"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if size <= 0 or chunk <= 0 or done < 0:
        return None
    return size, min(size, done * chunk)


def available(store: str, digest: str):
    """What the store holds of a blob: ``(path, size, verified_bytes,
    complete)`` or None.  A ``.part`` without its state file counts as absent."""
    files = BlobFiles(store, digest)
    for _ in range(2):          # the fetch may rename .part -> complete between our looks
        try:
            size = os.stat(files.path).st_size
            return files.path, size, size, True
        except OSError:
            pass
        found = state_verified_bytes(read_json(files.state), digest)
        if found and os.path.exists(files.part):
            return files.part, found[0], found[1], False
    return None


def list_blobs(store: str) -> list:
    """Blobs held, complete and partial, sorted by digest: ``{"digest", "state":
    "complete"|"partial", "path", "size", "verified_bytes"}``."""
    adopt_old_images(store)
    try:
        names = os.listdir(blobs_dir(store))
    except OSError:
        return []
    found = {}
    for name in names:
        digest, ext = name[:64], name[64:]
        if not DIGEST_RE.match(digest) or ext not in ("", STATE):
            continue
        held = available(store, digest)
        if held and (ext == "" or digest not in found):
            path, size, verified, complete = held
            found[digest] = {"digest": digest, "state": "complete" if complete else "partial",
                             "path": path, "size": size, "verified_bytes": verified}
    return [found[d] for d in sorted(found)]


def hash_file(path: str, on_bytes=None) -> tuple:
    """``(sha256 hex, size)`` of a file; ``on_bytes(done)`` is called as it goes."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(1 << 20)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(memoryview(buf)[:n])
            size += n
            if on_bytes is not None:
                on_bytes(size)
    return h.hexdigest(), size


def _in_use(path: str) -> bool:
    """True when a fetch holds the flock on this ``.part`` (it is still writing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def adopt_old_images(store: str) -> list:
    """Move what an agent before 0.2 left in ``<store>/images/`` (``<d>.img``,
    ``<d>.part`` + ``<d>.state.json``) to ``<store>/blobs/``; the digests moved.

    A rename on one file system: no copy, and a blob already here wins (the
    old file is left where it was).  A ``.part`` an older fetch still writes
    stays until that fetch has ended."""
    old_dir = os.path.join(store, OLD_DIR)
    try:
        names = sorted(os.listdir(old_dir))
    except OSError:
        return []
    moved = []
    os.makedirs(blobs_dir(store), exist_ok=True)
    for name in names:
        digest, ext = name[:64], name[64:]
        if not DIGEST_RE.match(digest) or ext not in (OLD_COMPLETE, PART):
            continue
        files = BlobFiles(store, digest)
        old = os.path.join(old_dir, name)
        if os.path.exists(files.path) or os.path.exists(files.part):
            continue
        try:
            if ext == OLD_COMPLETE:
                os.replace(old, files.path)
            elif not _in_use(old) and os.path.exists(os.path.join(old_dir, digest + STATE)):
                os.replace(os.path.join(old_dir, digest + STATE), files.state)
                os.replace(old, files.part)
            else:
                continue
        except OSError:
            continue                      # another agent command moved it first
        moved.append(digest)
    try:
        for name in os.listdir(old_dir):
            if name.startswith("."):      # the old state file's temporary name
                remove_quietly(os.path.join(old_dir, name))
        os.rmdir(old_dir)
    except OSError:
        pass                              # something not ours is left there: leave it be
    return moved

