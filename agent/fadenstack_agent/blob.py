"""``blob fetch|verify|list``: content-addressed files of any kind in the store.

The transfer layer under runtime images (``image``) and, next, model files:
a blob is known by its sha256, its size, its chunk size and its chunks'
sha256.  The files are in ``blobstore``, the spec in ``blobspec``, the HTTP
client in ``blobfetch`` and the server other machines fetch from in
``blobserve``.  The functions here take the words that name the file, so that
``image fetch`` is this same code speaking of "the runtime image".
"""

import os
import time

from .blobfetch import Fetch
from .blobspec import parse_spec, read_spec
from .blobstore import BlobFiles, adopt_old_images, available, check_digest, hash_file, list_blobs
from .cli import DIGEST, STORE, command, group
from .files import human, remove_quietly, store_dir
from .protocol import NOT_RETRYABLE, RETRYABLE, AgentError

PROGRESS_EVERY = 0.25

group("blob", help="content-addressed files in the store (any kind)")


def fetch(args, out, noun: str = "blob", what=None) -> int:
    """Read the spec on stdin and fetch the blob it names (see ``cmd_fetch``)."""
    spec = parse_spec(read_spec(noun=noun), noun)
    return out.result(**Fetch(spec, store_dir(args.store), out, what).run())


def complete_path(store: str, digest: str, noun: str = "blob") -> str:
    """The finished file of a blob, or an error saying what the store holds of it."""
    adopt_old_images(store)
    files = BlobFiles(store, digest)
    if os.path.isfile(files.path):
        return files.path
    held = available(store, digest)
    if held:
        raise AgentError(RETRYABLE, "%s %s is not complete in %s: %s of %s verified so far; `%s fetch` "
                                    "finishes it" % (noun, digest[:12], store, human(held[2]), human(held[1]),
                                                     noun))
    raise AgentError(NOT_RETRYABLE, "there is no %s %s in %s" % (noun, digest[:12], store))


def verify(args, out, noun: str = "blob") -> int:
    """Hash a finished blob whole (see ``cmd_verify``)."""
    digest = check_digest(args.digest)
    path = complete_path(store_dir(args.store), digest, noun)
    total = os.path.getsize(path)
    started, last = time.monotonic(), [0.0]

    def on_bytes(done):
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY:
            last[0] = now
            out.progress(digest=digest, bytes=done, total=total)

    found, size = hash_file(path, on_bytes)
    if found != digest:
        remove_quietly(path)
        raise AgentError(NOT_RETRYABLE, "%s is damaged: its sha256 is %s, not %s; removed it, fetch the "
                                        "%s again" % (path, found, digest, noun))
    return out.result(ok=True, digest=digest, size=size, seconds=round(time.monotonic() - started, 3))


# ------------------------------------------------------------------ commands


@command("blob", "fetch", args=[STORE])
def cmd_fetch(args, out) -> int:
    """``blob fetch [--store PATH]`` with the JSON spec on stdin (see ``blobspec``).

    Room check first (``no_room``, nothing written), then ``<digest>.part`` +
    ``<digest>.state.json``, resuming at the last verified chunk; drops are
    retried with growing pauses for ``retry_seconds`` (then ``unreachable``;
    a source answering 404 all along: ``not_retryable``); a chunk failing its
    sha256 is fetched again up to 3 times (then ``retryable``); a whole file
    whose sha256 is not the digest is removed (``not_retryable``).  Progress,
    at most every 0.25 s: ``{"event": "progress", "digest", "bytes", "total",
    "rate", "resumed_at"}``.  Result: ``{"path", "digest", "size",
    "bytes_fetched", "resumed_from", "seconds", "rate"}``
    (``"already_complete": true`` and ``bytes_fetched: 0`` when it was here).
    """
    return fetch(args, out)


@command("blob", "verify", args=[STORE, DIGEST])
def cmd_verify(args, out) -> int:
    """``blob verify --digest D [--store PATH]``: hash the whole finished blob.

    Progress: ``{"event": "progress", "digest", "bytes", "total"}``.  Result:
    ``{"ok": true, "digest", "size", "seconds"}``.  A file whose sha256
    differs is removed (it can never be used) and reported as
    ``not_retryable``; a partial one is ``retryable``; none ``not_retryable``.
    """
    return verify(args, out)


@command("blob", "list", args=[STORE])
def cmd_list(args, out) -> int:
    """``blob list [--store PATH]``: the blobs held, complete and partial.

    Result: ``{"store", "blobs": [{"digest", "state": "complete"|"partial",
    "path", "size", "verified_bytes"}]}``.
    """
    store = store_dir(args.store)
    return out.result(store=store, blobs=list_blobs(store))
