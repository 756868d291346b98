"""The HTTP client behind ``blob fetch`` (and ``image fetch``): a room check
before anything is written, range requests from the last verified chunk,
chunk-by-chunk sha256 checks, resume after a cut, a whole-file digest check
at the end.

Only verified chunks are ever written to ``<digest>.part``, and the state file
is rewritten after each one, so the local blob server can forward them while
the rest is still arriving.
"""

import errno
import fcntl
import hashlib
import http.client
import os
import re
import time
import urllib.parse

from . import get_version
from .blobstore import BlobFiles, adopt_old_images, write_state
from .files import free_bytes, fsync_dir, human, read_json, remove_quietly
from .pinning import PinMismatch, connection_class
from .protocol import NO_ROOM, NOT_RETRYABLE, RETRYABLE, UNREACHABLE, AgentError

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 30.0
PROGRESS_EVERY = 0.25
PIECE = 1 << 20
WINDOW_BYTES = 32 << 20          # bytes asked for in one request (whole chunks, at least one)
MAX_BAD = 3                      # refetches of one chunk that fails its hash
FIRST_PAUSE, MAX_PAUSE = 0.25, 10.0
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class _Dropped(Exception):
    """The source went away or answered something worth retrying."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


def _hashes_id(hashes) -> str:
    return hashlib.sha256("".join(hashes).encode("ascii")).hexdigest()


class Fetch:
    """One fetch of a blob: ``Fetch(spec, store, out).run()`` -> result dict.

    ``what`` names the file in the messages ("the runtime image")."""

    def __init__(self, spec: dict, store: str, out, what=None):
        self.spec, self.out = spec, out
        self.digest, self.size, self.chunk = spec["digest"], spec["size"], spec["chunk_size"]
        self.hashes = spec["chunk_hashes"]
        self.what = what or "the file %s" % self.digest[:12]
        self.files = BlobFiles(store, self.digest)
        parts = urllib.parse.urlsplit(spec["url"])
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port
        self.target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
        host = "[%s]" % self.host if ":" in self.host else self.host
        self.where = "%s://%s%s%s" % (parts.scheme, host, ":%d" % self.port if self.port else "", parts.path)
        self.fd = None
        self.verified = 0            # leading chunks verified and written
        self.fetched = 0             # bytes received from the network, all attempts
        self.bad = {}
        self.whole = hashlib.sha256()
        self.buf = memoryview(bytearray(self.chunk))
        self.started = time.monotonic()
        self.resumed_at = 0
        self.last_progress = 0.0

    # -------------------------------------------------------------- top level

    def run(self) -> dict:
        adopt_old_images(self.files.store)
        done = self._already_here()
        if done:
            return done
        self._check_room()
        f = self.files
        os.makedirs(f.dir, exist_ok=True)
        self.fd = os.open(f.part, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise AgentError(RETRYABLE, "another fetch of %s is running on this machine" % self.what)
            done = self._already_here(drop_empty_part=True)
            if done:
                return done
            self._resume()
            self._transfer()
            return self._finish()
        finally:
            os.close(self.fd)

    def _already_here(self, drop_empty_part=False):
        try:
            size = os.stat(self.files.path).st_size
        except OSError:
            return None
        if size != self.size:
            self.out.log("%s has %d bytes, not %d: fetching it again" % (self.files.path, size, self.size))
            os.unlink(self.files.path)
            return None
        if drop_empty_part and os.fstat(self.fd).st_size == 0 and not os.path.exists(self.files.state):
            os.unlink(self.files.part)
        return {"path": self.files.path, "digest": self.digest, "size": self.size, "bytes_fetched": 0,
                "resumed_from": self.size, "seconds": 0.0, "rate": 0, "already_complete": True}

    def _check_room(self) -> None:
        try:
            have = min(self.size, os.stat(self.files.part).st_size)
        except OSError:
            have = 0
        need = self.size - have
        free = free_bytes(self.files.dir)
        if need > free:
            here = " (%s of its %s are already here)" % (human(have), human(self.size)) if have else ""
            raise AgentError(NO_ROOM, "Needs %s free in %s for %s%s; %s are free."
                             % (human(need), self.files.store, self.what, here, human(free)))

    def _state(self) -> dict:
        return {"digest": self.digest, "size": self.size, "chunk_size": self.chunk,
                "chunks": len(self.hashes), "hashes_sha256": _hashes_id(self.hashes),
                "verified_chunks": self.verified, "verified_bytes": self._done(),
                "source": self.where, "updated": round(time.time(), 3)}

    def _done(self) -> int:
        return min(self.size, self.verified * self.chunk)

    def _save_state(self) -> None:
        try:
            write_state(self.files, self._state())
        except OSError as exc:
            raise self._write_error(exc)

    def _write_error(self, exc) -> AgentError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return AgentError(NO_ROOM, "The store %s ran out of room after %s of %s; %s are free. "
                                       "The %s verified so far are kept for a later fetch."
                              % (self.files.store, human(self._done()), self.what,
                                 human(free_bytes(self.files.dir)), human(self._done())))
        return AgentError(RETRYABLE, "cannot write %s: %s" % (self.files.part, exc.strerror or exc))

    # -------------------------------------------------------------- resume

    def _resume(self) -> None:
        """Trust the chunks the state file lists, after hashing them again."""
        state = read_json(self.files.state) or {}
        trusted = 0
        if all(state.get(k) == v for k, v in (("digest", self.digest), ("size", self.size),
                                              ("chunk_size", self.chunk),
                                              ("hashes_sha256", _hashes_id(self.hashes)))):
            trusted = min(len(self.hashes), max(0, int(state.get("verified_chunks") or 0)))
        if trusted:
            self.out.log("checking the %s already here" % human(min(self.size, trusted * self.chunk)))
        for i in range(trusted):
            length = min(self.chunk, self.size - i * self.chunk)
            data = os.pread(self.fd, length, i * self.chunk)
            if len(data) != length or hashlib.sha256(data).hexdigest() != self.hashes[i]:
                self.out.log("chunk %d on disk does not match its hash; fetching from there" % i)
                break
            self.whole.update(data)
            self.verified = i + 1
        self.resumed_at = self._done()
        self._save_state()

    # -------------------------------------------------------------- transfer

    def _transfer(self) -> None:
        pause, since, last_error = FIRST_PAUSE, time.monotonic(), None
        while self.verified < len(self.hashes):
            before = self.verified
            try:
                again = self._one_request()
            except _Dropped as exc:
                again, last_error = False, exc
            now = time.monotonic()
            if self.verified > before:
                pause, since = FIRST_PAUSE, now
            if self.verified >= len(self.hashes) or again:
                continue
            if now + pause - since > self.spec["retry_seconds"]:
                if last_error is not None and last_error.status == 404:
                    raise AgentError(NOT_RETRYABLE, "%s does not hold %s (HTTP 404 for %d s)"
                                     % (self.where, self.what, now - since))
                raise AgentError(UNREACHABLE, "could not get %s from %s for %d s (at byte %d of %d): %s"
                                 % (self.what, self.where, now - since, self._done(), self.size, last_error))
            self.out.log("source %s: %s; trying again from byte %d in %.2f s"
                         % (self.where, last_error, self._done(), pause))
            time.sleep(pause)
            pause = min(MAX_PAUSE, pause * 2)

    def _connect(self):
        cls = connection_class(self.https, self.spec.get("pin") or "")
        conn = cls(self.host, self.port, timeout=CONNECT_TIMEOUT)
        try:
            conn.connect()
            conn.sock.settimeout(READ_TIMEOUT)
        except PinMismatch as exc:  # not the console it was told of: asking again changes nothing
            conn.close()
            raise AgentError(NOT_RETRYABLE, "%s: %s" % (self.where, exc))
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Dropped("cannot connect: %s" % (getattr(exc, "strerror", None) or exc))
        return conn

    def _one_request(self) -> bool:
        """One GET of a window of chunks from the first unverified one; True to ask
        again at once (the window is done, or a chunk failed its hash).

        Bounded windows, not ``bytes=start-``: a web server without backpressure
        (Daphne) would otherwise queue the whole rest of the file in memory
        for a slow reader."""
        start = self._done()
        end_chunk = min(len(self.hashes), self.verified + max(1, WINDOW_BYTES // self.chunk))
        end = min(self.size, end_chunk * self.chunk)
        conn = self._connect()
        try:
            headers = {"Range": "bytes=%d-%d" % (start, end - 1), "Accept-Encoding": "identity",
                       "User-Agent": "fadenstack-agent/" + get_version()}
            if self.spec.get("token"):
                headers["Authorization"] = "Bearer " + self.spec["token"]
            try:
                conn.request("GET", self.target, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise _Dropped("request failed: %s" % (getattr(exc, "strerror", None) or exc))
            skip = self._check_response(resp, start)
            while skip:
                skip -= self._read(resp, self.buf[:min(skip, len(self.buf))], start)
            for i in range(self.verified, end_chunk):
                length = min(self.chunk, self.size - i * self.chunk)
                data = self.buf[:length]
                got = 0
                while got < length:
                    got += self._read(resp, data[got:min(length, got + PIECE)], i * self.chunk + got)
                if hashlib.sha256(data).hexdigest() != self.hashes[i]:
                    self.bad[i] = self.bad.get(i, 0) + 1
                    if self.bad[i] > MAX_BAD:
                        raise AgentError(RETRYABLE, "chunk %d (bytes %d-%d) from %s failed its sha256 check "
                                                    "%d times: the source's copy is damaged"
                                         % (i, i * self.chunk, i * self.chunk + length - 1, self.where,
                                            self.bad[i]))
                    self.out.log("chunk %d from %s failed its sha256 check; fetching it again" % (i, self.where))
                    return True
                self._accept(i, data)
            return self.verified < len(self.hashes)
        finally:
            conn.close()

    def _check_response(self, resp, start) -> int:
        """Bytes to skip before ``start`` (a 200 to a range request), or raise."""
        status = resp.status
        if status == 206:
            m = CONTENT_RANGE.match(resp.getheader("Content-Range") or "")
            if not m or int(m.group(1)) != start:
                raise AgentError(NOT_RETRYABLE, "%s answered bytes %r to a request from byte %d"
                                 % (self.where, resp.getheader("Content-Range"), start))
            if m.group(3) != "*" and int(m.group(3)) != self.size:
                raise AgentError(NOT_RETRYABLE, "%s holds a file of %s bytes, not %d: another build of %s"
                                 % (self.where, m.group(3), self.size, self.what))
            return 0
        if status == 200:
            length = resp.getheader("Content-Length")
            if length and length.isdigit() and int(length) != self.size:
                raise AgentError(NOT_RETRYABLE, "%s holds a file of %s bytes, not %d: another build of %s"
                                 % (self.where, length, self.size, self.what))
            return start
        try:
            body = resp.read(2000).decode("utf-8", "replace").strip()
        except (OSError, http.client.HTTPException):
            body = ""
        said = "HTTP %d %s%s" % (status, resp.reason, (": " + body) if body else "")
        if status == 404 or status == 408 or status == 429 or status >= 500:
            raise _Dropped(said, status)
        if status == 416:
            raise AgentError(NOT_RETRYABLE, "%s has no byte %d of %s (%s): another build of it"
                             % (self.where, start, self.what, said))
        if status in (401, 403):
            raise AgentError(NOT_RETRYABLE, "%s refused the request (%s)" % (self.where, said))
        raise AgentError(NOT_RETRYABLE, "%s answered %s" % (self.where, said))

    def _read(self, resp, into, at) -> int:
        try:
            n = resp.readinto(into)
        except (OSError, http.client.HTTPException) as exc:
            raise _Dropped("connection lost at byte %d: %s" % (at, getattr(exc, "strerror", None) or exc))
        if not n:
            raise _Dropped("connection closed at byte %d" % at)
        self.fetched += n
        return n

    def _accept(self, i, data) -> None:
        offset, view = i * self.chunk, data
        try:
            while view:
                written = os.pwrite(self.fd, view, offset)
                view, offset = view[written:], offset + written
        except OSError as exc:
            raise self._write_error(exc)
        self.whole.update(data)
        self.verified = i + 1
        self._save_state()
        now = time.monotonic()
        if now - self.last_progress >= PROGRESS_EVERY:
            self.last_progress = now
            self.out.progress(digest=self.digest, bytes=self._done(), total=self.size,
                              rate=self._rate(now), resumed_at=self.resumed_at)

    def _rate(self, now) -> int:
        return int((self._done() - self.resumed_at) / max(now - self.started, 1e-6))

    # -------------------------------------------------------------- the end

    def _finish(self) -> dict:
        f = self.files
        if self.whole.hexdigest() != self.digest:
            for path in (f.part, f.state):
                remove_quietly(path)
            raise AgentError(NOT_RETRYABLE, "every chunk matched its hash but the whole file's sha256 is %s, "
                                            "not %s: the spec's chunk hashes belong to another file"
                             % (self.whole.hexdigest(), self.digest))
        try:
            os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        except OSError as exc:
            raise self._write_error(exc)
        os.replace(f.part, f.path)
        remove_quietly(f.state)
        fsync_dir(f.dir)
        now = time.monotonic()
        return {"path": f.path, "digest": self.digest, "size": self.size, "bytes_fetched": self.fetched,
                "resumed_from": self.resumed_at, "seconds": round(now - self.started, 3),
                "rate": self._rate(now)}
