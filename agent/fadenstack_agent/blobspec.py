"""The fetch spec that ``blob fetch`` and ``image fetch`` read on stdin::

    {"digest": "<sha256 of the whole file>", "size": N, "chunk_size": C,
     "chunk_hashes": ["<sha256 of chunk 0>", ...],
     "source": {"url": "http://HOST:PORT/blobs/<digest>", "token": "...", "pin": "<sha256>"},
     "retry_seconds": 90}

``token``, ``pin`` and ``retry_seconds`` are optional; ``pin`` (the SHA-256 of the console's certificate,
pinning.py) goes with an https:// URL, which then accepts that certificate only.  The source is the server (with
a token) or another machine's blob server; either answers HTTP range requests.
The spec comes on stdin, not in argv, because the token must not show in ``ps``.
"""

import json
import os
import select
import time
import urllib.parse

from .blobstore import DIGEST_RE, check_digest
from .pinning import parse_pin
from .protocol import BAD_INPUT, AgentError

SPEC_WAIT = 30.0
SPEC_MAX = 64 * 1024 * 1024
MIN_CHUNK, MAX_CHUNK = 4096, 1024 * 1024 * 1024


def read_spec(fd: int = 0, wait: float = SPEC_WAIT, noun: str = "blob") -> bytes:
    """The JSON spec from stdin: up to EOF, or as soon as what arrived parses
    (an SSH client may keep stdin open after sending it)."""
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
            raise AgentError(BAD_INPUT, "no %s spec arrived on stdin within %d s: send one JSON "
                                        "object {\"digest\", \"size\", \"chunk_size\", \"chunk_hashes\", "
                                        "\"source\": {\"url\"}}" % (noun, wait))
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


def _int(spec, key, low, high, noun):
    value = spec.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise AgentError(BAD_INPUT, "the %s spec needs %r as a whole number from %d to %d, got %s"
                         % (noun, key, low, high, json.dumps(value)[:80]))
    return value


def parse_spec(raw: bytes, noun: str = "blob") -> dict:
    """Check a fetch spec; a normalised dict (``digest``, ``size``,
    ``chunk_size``, ``chunk_hashes``, ``url``, ``token``, ``retry_seconds``),
    or ``bad_input`` saying what is wrong.  ``noun`` names the file in the
    messages ("image" for ``image fetch``)."""
    try:
        spec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise AgentError(BAD_INPUT, "the %s spec on stdin is not valid JSON: %s" % (noun, exc))
    if not isinstance(spec, dict):
        raise AgentError(BAD_INPUT, "the %s spec on stdin must be a JSON object" % noun)
    if "digest" not in spec:
        raise AgentError(BAD_INPUT, "the %s spec has no \"digest\" (the sha256 of the whole file)" % noun)
    digest = check_digest(spec["digest"], "the spec's \"digest\"")
    size = _int(spec, "size", 1, 1 << 50, noun)
    chunk = _int(spec, "chunk_size", MIN_CHUNK, MAX_CHUNK, noun)
    hashes = spec.get("chunk_hashes")
    count = (size + chunk - 1) // chunk
    if not isinstance(hashes, list):
        raise AgentError(BAD_INPUT, "the %s spec needs \"chunk_hashes\": a list of the sha256 of "
                                    "every chunk" % noun)
    if len(hashes) != count:
        article = "an" if noun[0] in "aeiou" else "a"
        raise AgentError(BAD_INPUT, "the %s spec has %d chunk_hashes, but %s %s of %d bytes in chunks of "
                                    "%d bytes has %d chunks" % (noun, len(hashes), article, noun, size, chunk,
                                                                count))
    for i, h in enumerate(hashes):
        if not isinstance(h, str) or not DIGEST_RE.match(h.lower()):
            raise AgentError(BAD_INPUT, "chunk_hashes[%d] is not a sha256 in hex: %s" % (i, json.dumps(h)[:80]))
    example = "http://HOST:PORT/%ss/<digest>" % noun
    source = spec.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("url"), str):
        raise AgentError(BAD_INPUT, "the %s spec needs \"source\": {\"url\": \"%s\"} (and optionally "
                                    "\"token\")" % (noun, example))
    url = source["url"]
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or any(c.isspace() for c in url):
        raise AgentError(BAD_INPUT, "the source url must look like %s, got %r" % (example, url[:200]))
    token = source.get("token")
    if token is not None and (not isinstance(token, str) or not token or len(token) > 8192
                              or any(c.isspace() or ord(c) < 32 for c in token)):
        raise AgentError(BAD_INPUT, "the source token must be a non-empty string without spaces")
    pin = source.get("pin") or ""
    if pin:
        pin = parse_pin(pin)
        if parts.scheme != "https":
            raise AgentError(BAD_INPUT, "the source's pin goes with an https:// url, got %r" % url[:200])
    retry = spec.get("retry_seconds", 90)
    if isinstance(retry, bool) or not isinstance(retry, (int, float)) or not (0 <= retry <= 3600):
        raise AgentError(BAD_INPUT, "retry_seconds must be a number of seconds from 0 to 3600")
    return {"digest": digest, "size": size, "chunk_size": chunk,
            "chunk_hashes": [h.lower() for h in hashes], "url": url, "token": token,
            "pin": pin, "retry_seconds": float(retry)}
