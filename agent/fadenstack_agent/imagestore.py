"""The runtime image store on disk, shared by ``image`` and ``image serve``.

Under ``<store>/images/``: ``<digest>.img`` (a finished, digest-checked
image), or ``<digest>.part`` plus ``<digest>.state.json`` while it arrives.
The state file says how many leading chunks of the ``.part`` are verified
(their sha256 matched); it is rewritten (temporary file + rename) after each
chunk, so a reader never sees half of it.  ``<store>/runtime/loaded.json``
records the image ``image load`` read last.
"""

import json
import os
import re

from .protocol import BAD_INPUT, AgentError

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
MiB = 1024 * 1024


def check_digest(text, what="--digest") -> str:
    """A sha256 hex digest (64 hex digits), lower-cased; bad_input otherwise."""
    value = text.strip().lower() if isinstance(text, str) else text
    if not isinstance(value, str) or not DIGEST_RE.match(value):
        raise AgentError(BAD_INPUT, "%s must be the image's sha256 as 64 hex digits, got %r"
                         % (what, text if not isinstance(text, str) else text[:80]))
    return value


def human(n) -> str:
    """Bytes for people: ``256.0 MiB`` (GiB from 10 GiB on)."""
    if n >= 10 * 1024 * MiB:
        return "%.1f GiB" % (n / (1024.0 * MiB))
    return "%.1f MiB" % (n / float(MiB))


class ImageFiles:
    """The file names of one image in one store."""

    def __init__(self, store: str, digest: str):
        self.store = store
        self.digest = digest
        self.dir = os.path.join(store, "images")
        base = os.path.join(self.dir, digest)
        self.img = base + ".img"
        self.part = base + ".part"
        self.state = base + ".state.json"
        self.state_tmp = os.path.join(self.dir, "." + digest + ".state.json.tmp")


def read_state(path: str):
    """The state file as a dict, or None when absent or unreadable."""
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_state(files: ImageFiles, state: dict) -> None:
    """Replace the state file in one step (no fsync: the ``.part`` is fsynced
    at the end, and a resume re-checks the chunks it trusts)."""
    data = json.dumps(state, separators=(",", ":")).encode("utf-8")
    fd = os.open(files.state_tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(files.state_tmp, files.state)


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
    """What the store holds of an image: ``(path, size, verified_bytes,
    complete)`` or None.  A ``.part`` without its state file counts as absent."""
    files = ImageFiles(store, digest)
    for _ in range(2):          # the fetch may rename .part -> .img between our looks
        try:
            size = os.stat(files.img).st_size
            return files.img, size, size, True
        except OSError:
            pass
        found = state_verified_bytes(read_state(files.state), digest)
        if found and os.path.exists(files.part):
            return files.part, found[0], found[1], False
    return None


def free_bytes(path: str) -> int:
    """Free bytes (for an unprivileged writer) of the file system holding
    ``path``, or of its nearest existing parent."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def loaded_path(store: str) -> str:
    return os.path.join(store, "runtime", "loaded.json")


def read_loaded(store: str) -> dict:
    data = read_state(loaded_path(store))
    return data or {}


def list_images(store: str) -> list:
    """Images held, complete and partial, sorted by digest."""
    directory = os.path.join(store, "images")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    loaded = read_loaded(store).get("digest")
    found = {}
    for name in names:
        digest, _, ext = name.partition(".")
        if not DIGEST_RE.match(digest) or ext not in ("img", "state.json"):
            continue
        files = ImageFiles(store, digest)
        if ext == "img":
            try:
                size = os.stat(files.img).st_size
            except OSError:
                continue
            found[digest] = {"digest": digest, "state": "complete", "path": files.img, "size": size,
                             "verified_bytes": size, "loaded": digest == loaded}
        elif digest not in found:
            state = read_state(files.state)
            sizes = state_verified_bytes(state, digest) if state else None
            if sizes:
                found.setdefault(digest, {
                    "digest": digest, "state": "partial", "path": files.part, "size": sizes[0],
                    "verified_bytes": sizes[1], "loaded": False})
    return [found[d] for d in sorted(found)]
