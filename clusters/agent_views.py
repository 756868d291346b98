"""What the machines' agents fetch from the console: the first copy of a runtime image.

Served under an ASGI server (Daphne). Django's ASGI handler buffers a
*synchronous* streaming response whole before sending it (``sync_to_async(list)``
in ``StreamingHttpResponse.__aiter__``), which for an image means its whole size
in memory per download. ``FileRangeResponse`` therefore streams asynchronously
under ASGI, one 1 MiB piece at a time read in a worker thread, and synchronously
under WSGI and the test client.
"""
from __future__ import annotations

import asyncio
import os
import re

from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.http import require_http_methods

from clusters import images
from clusters.models import RuntimeImage
from console.agent_tls import agents_over_tls
from console.params import shown

PIECE_SIZE = 1024 * 1024
# One range, in the digits 0-9 (not \d, which matches every script's digits) and short enough for int().
_RANGE = re.compile(r"bytes=([0-9]{0,19})-([0-9]{0,19})")


class FilePieces:
    """Bytes ``start`` to ``end`` (inclusive) of an open file, in pieces; iterable both ways, closed once."""

    def __init__(self, fd: int, start: int, end: int):
        self.fd, self.start, self.end = fd, start, end

    def _pieces(self):
        position = self.start
        while position <= self.end:
            yield position, min(PIECE_SIZE, self.end + 1 - position)
            position += PIECE_SIZE

    def __iter__(self):
        for position, length in self._pieces():
            piece = os.pread(self.fd, length, position)
            if not piece:
                return  # the file shrank under us: the client sees a short body, not our stack trace
            yield piece

    async def aiter(self):
        for position, length in self._pieces():
            piece = await asyncio.to_thread(os.pread, self.fd, length, position)
            if not piece:
                return
            yield piece

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FileRangeResponse(StreamingHttpResponse):
    """A file's bytes, streamed in 1 MiB pieces without holding them: sync under WSGI, async under ASGI."""

    def __init__(self, pieces: FilePieces, **kwargs):
        super().__init__(pieces, **kwargs)
        self.pieces = pieces
        self._own_iterator = self._iterator

    async def __aiter__(self):
        if self._iterator is not self._own_iterator:  # a middleware wrapped the content: let Django handle it
            async for part in super().__aiter__():
                yield part
            return
        async for piece in self.pieces.aiter():
            yield piece


def requested_range(header: str, size: int) -> tuple[int, int] | None:
    """``(start, end)`` inclusive for ``bytes=a-b``, ``bytes=a-`` or ``bytes=-n``; None when unsatisfiable or malformed."""
    match = _RANGE.fullmatch(header.strip().replace(" ", "")) if len(header) <= 100 else None
    if not match or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if first == "":  # the last n bytes
        start, end = max(size - int(last), 0), size - 1
        return (start, end) if int(last) > 0 and size > 0 else None
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    return (start, end) if start < size and start <= end else None


def open_whole(path, size: int) -> int | None:
    """A file opened (so that a later replace cannot change what we send), or None unless it is whole."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    if os.fstat(fd).st_size != size:
        os.close(fd)
        return None
    return fd


@login_not_required
@require_http_methods(["GET", "HEAD"])
@agents_over_tls
def runtime_image_download(request: HttpRequest, digest: str):
    """A runtime image for a machine, with ``Range`` support: ``Authorization: Bearer <image download token>``."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    refusal = images.image_download_refusal(token.strip() if scheme == "Bearer" else "", digest=digest)
    if refusal:
        return JsonResponse({"error": refusal}, status=401)
    image = RuntimeImage.objects.filter(digest=digest).first()
    fd = open_whole(image.path, image.size_bytes) if image else None
    if fd is None:
        return JsonResponse({"error": f"The server does not hold the image {digest[:12]}; "
                                      "run faden runtime-images --check on the server."}, status=404)
    return file_response(request, fd, size=image.size_bytes, digest=digest, what="the image")


def file_response(request: HttpRequest, fd: int, *, size: int, digest: str, what: str) -> HttpResponse:
    """The bytes of an open, whole, content-addressed file (closed when sent), with ``Range`` and ``HEAD``:
    the answer machines fetch the first copy of a file from (a runtime image, a model's file)."""
    start, end, status = 0, size - 1, 200
    if "Range" in request.headers:
        wanted = requested_range(request.headers["Range"], size)
        if wanted is None:
            os.close(fd)
            response = JsonResponse({"error": f"Range {shown(request.headers['Range'])} is not one range within "
                                              f"{what}'s {size} bytes."}, status=416)
            response["Content-Range"] = f"bytes */{size}"
            return response
        (start, end), status = wanted, 206
    length = max(end - start + 1, 0)
    if request.method == "HEAD":
        os.close(fd)
        response = HttpResponse(status=status, content_type="application/octet-stream")
    else:
        response = FileRangeResponse(FilePieces(fd, start, end), status=status, content_type="application/octet-stream")
    response["Content-Length"] = str(length)
    response["Accept-Ranges"] = "bytes"
    response["ETag"] = f'"{digest}"'  # a digest names one content forever
    if status == 206:
        response["Content-Range"] = f"bytes {start}-{end}/{size}"
    return response
