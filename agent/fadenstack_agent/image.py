"""``image fetch|verify|load|list``: the runtime image store (``image serve``
lives in ``imageserve``, the files in ``imagestore``, the HTTP client in
``imagefetch``).

``image fetch`` takes its spec as one JSON object on stdin::

    {"digest": "<sha256 of the whole file>", "size": N, "chunk_size": C,
     "chunk_hashes": ["<sha256 of chunk 0>", ...],
     "source": {"url": "http://HOST:PORT/images/<digest>", "token": "..."},
     "retry_seconds": 90}

(``token`` and ``retry_seconds`` are optional.)
"""

import json
import os
import select
import tarfile
import time
import urllib.parse

from . import imagestore
from .imagestore import DIGEST_RE, ImageFiles, check_digest, human
from .paths import atomic_write, store_dir
from .protocol import BAD_INPUT, NOT_RETRYABLE, RETRYABLE, AgentError, needs_action

ACTIONS = ("fetch", "verify", "load", "list", "serve")
SPEC_WAIT = 30.0
SPEC_MAX = 64 * 1024 * 1024
MIN_CHUNK, MAX_CHUNK = 4096, 1024 * 1024 * 1024
MANIFEST_MAX = 1024 * 1024


# ------------------------------------------------------------------ the spec


def read_spec(fd: int = 0, wait: float = SPEC_WAIT) -> bytes:
    """The JSON spec from stdin: up to EOF, or as soon as what arrived parses."""
    data = b""
    deadline = time.monotonic() + wait
    while len(data) <= SPEC_MAX:
        left = deadline - time.monotonic()
        try:
            ready = left > 0 and select.select([fd], [], [], left)[0]
            chunk = os.read(fd, 1 << 20) if ready else None
        except OSError:
            chunk = b""
        if chunk is None:
            if data.strip():
                break
            raise AgentError(BAD_INPUT, "no image spec arrived on stdin within %d s: send one JSON "
                                        "object {\"digest\", \"size\", \"chunk_size\", \"chunk_hashes\", "
                                        "\"source\": {\"url\"}}" % wait)
        if not chunk:
            break
        data += chunk
        if data.rstrip().endswith(b"}"):
            try:
                json.loads(data.decode("utf-8"))
                break
            except ValueError:
                continue
    return data


def _int(spec, key, low, high):
    value = spec.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise AgentError(BAD_INPUT, "the image spec needs %r as a whole number from %d to %d, got %s"
                         % (key, low, high, json.dumps(value)[:80]))
    return value


def parse_spec(raw: bytes) -> dict:
    """Check a fetch spec; a normalised dict, or ``bad_input`` saying what is wrong."""
    try:
        spec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise AgentError(BAD_INPUT, "the image spec on stdin is not valid JSON: %s" % exc)
    if not isinstance(spec, dict):
        raise AgentError(BAD_INPUT, "the image spec on stdin must be a JSON object")
    if "digest" not in spec:
        raise AgentError(BAD_INPUT, "the image spec has no \"digest\" (the sha256 of the whole file)")
    digest = check_digest(spec["digest"], "the spec's \"digest\"")
    size = _int(spec, "size", 1, 1 << 50)
    chunk = _int(spec, "chunk_size", MIN_CHUNK, MAX_CHUNK)
    hashes = spec.get("chunk_hashes")
    count = (size + chunk - 1) // chunk
    if not isinstance(hashes, list):
        raise AgentError(BAD_INPUT, "the image spec needs \"chunk_hashes\": a list of the sha256 of "
                                    "every chunk")
    if len(hashes) != count:
        raise AgentError(BAD_INPUT, "the image spec has %d chunk_hashes, but an image of %d bytes in "
                                    "chunks of %d bytes has %d chunks" % (len(hashes), size, chunk, count))
    for i, h in enumerate(hashes):
        if not isinstance(h, str) or not DIGEST_RE.match(h.lower()):
            raise AgentError(BAD_INPUT, "chunk_hashes[%d] is not a sha256 in hex: %s" % (i, json.dumps(h)[:80]))
    source = spec.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("url"), str):
        raise AgentError(BAD_INPUT, "the image spec needs \"source\": {\"url\": \"http://HOST:PORT/images/"
                                    "<digest>\"} (and optionally \"token\")")
    url = source["url"]
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or any(c.isspace() for c in url):
        raise AgentError(BAD_INPUT, "the source url must look like http://HOST:PORT/images/<digest>, got %r"
                         % url[:200])
    token = source.get("token")
    if token is not None and (not isinstance(token, str) or not token or len(token) > 8192
                              or any(c.isspace() or ord(c) < 32 for c in token)):
        raise AgentError(BAD_INPUT, "the source token must be a non-empty string without spaces")
    retry = spec.get("retry_seconds", 90)
    if isinstance(retry, bool) or not isinstance(retry, (int, float)) or not (0 <= retry <= 3600):
        raise AgentError(BAD_INPUT, "retry_seconds must be a number of seconds from 0 to 3600")
    return {"digest": digest, "size": size, "chunk_size": chunk,
            "chunk_hashes": [h.lower() for h in hashes], "url": url, "token": token,
            "retry_seconds": float(retry)}


# ------------------------------------------------------------------ commands


def cmd_fetch(args, out) -> int:
    """``image fetch [--store PATH]`` with the JSON spec on stdin (see the module).

    Room check first (``no_room``, nothing written), then ``<digest>.part`` +
    ``<digest>.state.json``, resuming at the last verified chunk; drops are
    retried with growing pauses for ``retry_seconds`` (then ``unreachable``);
    a chunk failing its sha256 is fetched again up to 3 times (then
    ``retryable``).  Progress, at most every 0.25 s: ``{"event": "progress",
    "bytes", "total", "rate", "resumed_at"}``.  Result: ``{"path", "digest",
    "size", "bytes_fetched", "resumed_from", "seconds", "rate"}``
    (``"already_complete": true`` and ``bytes_fetched: 0`` when it was here).
    """
    from .imagefetch import Fetch

    spec = parse_spec(read_spec())
    return out.result(**Fetch(spec, store_dir(args.store), out).run())


def _complete_file(store: str, digest: str) -> str:
    files = ImageFiles(store, digest)
    if os.path.isfile(files.img):
        return files.img
    held = imagestore.available(store, digest)
    if held:
        raise AgentError(RETRYABLE, "image %s is not complete in %s: %s of %s verified so far; "
                                    "`image fetch` finishes it" % (digest[:12], store, human(held[2]),
                                                                   human(held[1])))
    raise AgentError(NOT_RETRYABLE, "there is no image %s in %s" % (digest[:12], store))


def cmd_verify(args, out) -> int:
    """``image verify --digest D [--store PATH]``: hash the whole finished image.

    Result: ``{"ok": true, "digest", "size", "seconds"}``.  A file whose
    sha256 differs is removed (it can never be used) and reported as
    ``not_retryable``; a partial one is ``retryable``; none ``not_retryable``.
    """
    import hashlib

    digest = check_digest(args.digest)
    store = store_dir(args.store)
    path = _complete_file(store, digest)
    started = time.monotonic()
    h, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(1 << 20)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(memoryview(buf)[:n])
            size += n
    if h.hexdigest() != digest:
        os.unlink(path)
        raise AgentError(NOT_RETRYABLE, "%s is damaged: its sha256 is %s, not %s; removed it, fetch the "
                                        "image again" % (path, h.hexdigest(), digest))
    return out.result(ok=True, digest=digest, size=size, seconds=round(time.monotonic() - started, 3))


def read_manifest(path: str) -> dict:
    """The ``manifest.json`` that must be the first member of a runtime image."""
    try:
        with tarfile.open(path, mode="r|") as tar:
            member = tar.next()
            if member is None or member.name.lstrip("./") != "manifest.json" or not member.isfile():
                raise AgentError(NOT_RETRYABLE, "%s is not a runtime image: its first member is %r, not "
                                                "manifest.json" % (path, member.name if member else None))
            if member.size > MANIFEST_MAX:
                raise AgentError(NOT_RETRYABLE, "%s: manifest.json is %d bytes, too big" % (path, member.size))
            raw = tar.extractfile(member).read()
    except (tarfile.TarError, OSError) as exc:
        raise AgentError(NOT_RETRYABLE, "%s is not a readable tar archive: %s" % (path, exc))
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise AgentError(NOT_RETRYABLE, "%s: manifest.json is not valid JSON: %s" % (path, exc))
    if not isinstance(manifest, dict) or not manifest.get("name") or not manifest.get("version"):
        raise AgentError(NOT_RETRYABLE, "%s: manifest.json must be an object with at least \"name\" "
                                        "and \"version\"" % path)
    return manifest


def cmd_load(args, out) -> int:
    """``image load --digest D [--store PATH]``: read the image's manifest and
    record it as the loaded runtime in ``<store>/runtime/loaded.json``
    (``{"digest", "path", "manifest", "loaded_at"}``).

    Result: ``{"manifest": {...}, "digest", "path"}``.
    """
    digest = check_digest(args.digest)
    store = store_dir(args.store)
    path = _complete_file(store, digest)
    manifest = read_manifest(path)
    record = {"digest": digest, "path": path, "manifest": manifest, "loaded_at": round(time.time(), 3)}
    target = imagestore.loaded_path(store)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    atomic_write(target, (json.dumps(record, indent=2) + "\n").encode("utf-8"), 0o644)
    return out.result(manifest=manifest, digest=digest, path=path)


def cmd_list(args, out) -> int:
    """``image list [--store PATH]``: the images held, complete and partial.

    Result: ``{"store", "images": [{"digest", "state": "complete"|"partial",
    "path", "size", "verified_bytes", "loaded"}]}``.
    """
    store = store_dir(args.store)
    return out.result(store=store, images=imagestore.list_images(store))


# ------------------------------------------------------------------ the command line


def add_commands(sub, parser_class) -> None:
    """Add ``image ...`` to the agent's command line (each parser sets ``handler``)."""
    from . import imageserve

    image = sub.add_parser("image", help="the runtime image store", allow_abbrev=False)
    image.set_defaults(handler=needs_action("image", ACTIONS))
    actions = image.add_subparsers(dest="image_action", metavar="ACTION", parser_class=parser_class)
    for name, handler, text, digest in (
            ("fetch", cmd_fetch, "fetch an image over HTTP (JSON spec on stdin)", False),
            ("verify", cmd_verify, "check a finished image's sha256", True),
            ("load", cmd_load, "read the image's manifest and mark it loaded", True),
            ("list", cmd_list, "images held, complete and partial", False)):
        parser = actions.add_parser(name, help=text, allow_abbrev=False)
        parser.add_argument("--store", metavar="PATH", help="store directory (default: the machine's)")
        if digest:
            parser.add_argument("--digest", required=True, metavar="SHA256", help="the image's sha256")
        parser.set_defaults(handler=handler)
    imageserve.add_commands(actions, parser_class)
