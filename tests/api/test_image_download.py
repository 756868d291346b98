"""/agent/images/<digest>/: the first copy of a runtime image, for a machine holding a token, with ranges."""
import asyncio
import os
import warnings

import pytest
from asgiref.sync import async_to_sync
from django.core import signals
from django.core.handlers.asgi import ASGIHandler
from django.db import close_old_connections
from django.test import Client

from clusters import agent_views, images
from clusters.choices import ClusterState
from clusters.models import Cluster
from tests.builders import cluster_of, gpu_machine
from lab import images as lab_images

pytestmark = pytest.mark.django_db

MIB = 1024 * 1024


@pytest.fixture
def image(settings, tmp_path):
    """An imported image of 3 MiB and a bit."""
    settings.DATA_DIR = tmp_path / "data"
    path = tmp_path / "x86.img"
    lab_images.synthetic_write(path, lab_images.BUILDS[0], 3 * MIB + 7)
    return images.runtime_image_import(path=path)


@pytest.fixture
def data(image):
    with open(image.path, "rb") as f:
        return f.read()


@pytest.fixture
def member(image):
    """The machine the token is for, in the cluster whose start made it."""
    return cluster_of([gpu_machine("gpu-a", 11)], state=ClusterState.STARTING, runtime=image).members.get()


def token_for(member, *, digest: str, lifetime: float = 600) -> str:
    grant = images.ImageGrant(digest=digest, cluster_id=member.cluster_id, machine_id=member.machine_id)
    return images.image_download_token(grant=grant, lifetime=lifetime)


@pytest.fixture
def token(image, member):
    return token_for(member, digest=image.digest)


@pytest.fixture
def agent():
    """What a machine's agent uses: a plain client, no session."""
    return Client(enforce_csrf_checks=True)


def url(image) -> str:
    return f"/agent/images/{image.digest}/"


def get(agent, image, token=None, method="get", **headers):
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return getattr(agent, method)(url(image), headers=headers)


def body(response) -> bytes:
    return b"".join(response.streaming_content)


def test_without_a_token_the_image_is_a_401_in_json(agent, image):
    response = get(agent, image)

    assert response.status_code == 401
    assert "Authorization: Bearer" in response.json()["error"]


@pytest.mark.parametrize("header", ["Bearer not-a-token", "Token {token}", "Bearer"])
def test_a_bad_token_or_another_scheme_is_a_401(agent, image, token, header):
    response = agent.get(url(image), headers={"Authorization": header.format(token=token)})

    assert response.status_code == 401


def test_a_token_made_for_another_image_is_refused(agent, image, member):
    response = get(agent, image, token_for(member, digest="0" * 64))

    assert response.status_code == 401
    assert response.json()["error"] == "This token is for another image."


def test_a_token_past_its_lifetime_is_refused(agent, image, member, monkeypatch):
    token = token_for(member, digest=image.digest, lifetime=300)
    now = images.time.time()
    monkeypatch.setattr(images.time, "time", lambda: now + 301)

    response = get(agent, image, token)

    assert response.status_code == 401
    assert "valid image token" in response.json()["error"]


def test_a_token_stops_working_when_its_cluster_is_being_deleted_or_is_gone(agent, image, member, token):
    Cluster.objects.filter(pk=member.cluster_id).update(state=ClusterState.DELETING)
    deleting = get(agent, image, token)
    member.cluster.delete()
    gone = get(agent, image, token)

    assert (deleting.status_code, gone.status_code) == (401, 401)
    assert gone.json()["error"] == "This token's cluster was deleted, or its machine is no longer in it."


def test_a_token_is_bound_to_its_machine_and_cluster(agent, image, member, token):
    other = cluster_of([gpu_machine("gpu-b", 12)], name="other-room", state=ClusterState.STARTING, runtime=image).members.get()
    for_a_machine_outside = images.ImageGrant(digest=image.digest, cluster_id=member.cluster_id, machine_id=other.machine_id)
    for_another_cluster = images.ImageGrant(digest=image.digest, cluster_id=other.cluster_id, machine_id=member.machine_id)

    assert get(agent, image, token).status_code == 200
    for grant in (for_a_machine_outside, for_another_cluster):
        response = get(agent, image, images.image_download_token(grant=grant, lifetime=600))
        assert response.status_code == 401
        assert "no longer in it" in response.json()["error"]
    member.delete()  # the machine was taken out of the cluster
    assert get(agent, image, token).status_code == 401


def test_an_image_the_server_does_not_hold_is_a_404(agent, image, token):
    os.unlink(image.path)

    response = get(agent, image, token)

    assert response.status_code == 404
    assert "faden runtime-images --check" in response.json()["error"]


def test_a_whole_get_returns_every_byte(agent, image, token, data):
    response = get(agent, image, token)

    assert response.status_code == 200
    assert response["Content-Length"] == str(image.size_bytes)
    assert response["Accept-Ranges"] == "bytes"
    assert response["Content-Type"] == "application/octet-stream"
    assert body(response) == data


@pytest.mark.parametrize(
    "header, start, end",
    [
        ("bytes=0-99", 0, 99),
        ("bytes=1048570-2097160", 1048570, 2097160),  # across a piece boundary
        ("bytes=2097152-", 2097152, None),  # to the end
        ("bytes=-10", -10, None),  # the last ten bytes
        ("bytes=3145000-99999999", 3145000, None),  # an end beyond the file stops at its end
    ],
)
def test_a_range_request_returns_206_with_that_slice(agent, image, token, data, header, start, end):
    response = get(agent, image, token, Range=header)

    expected = data[start:] if end is None else data[start:end + 1]
    first = start if start >= 0 else image.size_bytes + start
    assert response.status_code == 206
    assert body(response) == expected
    assert response["Content-Length"] == str(len(expected))
    assert response["Content-Range"] == f"bytes {first}-{first + len(expected) - 1}/{image.size_bytes}"


@pytest.mark.parametrize("header", ["bytes=99999999-", "bytes=10-5", "bytes=0-1,5-6", "lines=0-5", "bytes=-"])
def test_a_bad_range_is_a_416(agent, image, token, header):
    response = get(agent, image, token, Range=header)

    assert response.status_code == 416
    assert response["Content-Range"] == f"bytes */{image.size_bytes}"


def test_head_gives_the_length_and_no_body(agent, image, token):
    response = get(agent, image, token, method="head")

    assert response.status_code == 200
    assert response["Content-Length"] == str(image.size_bytes)
    assert response["Accept-Ranges"] == "bytes"
    assert response.content == b""


def test_head_of_a_range_gives_its_length(agent, image, token):
    response = get(agent, image, token, method="head", Range="bytes=10-19")

    assert response.status_code == 206
    assert response["Content-Length"] == "10"
    assert response["Content-Range"] == f"bytes 10-19/{image.size_bytes}"


def test_other_methods_are_refused(agent, image, token):
    assert Client().post(url(image), headers={"Authorization": f"Bearer {token}"}).status_code == 405


# -- under the ASGI server ----------------------------------------------------------------


def asgi_get(path: str, headers: dict[str, str]) -> tuple[int, dict, list[bytes]]:
    """One request through Django's ASGI handler, as Daphne makes it; the status, headers and body messages."""
    messages, requests = [], [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client never disconnects: wait until cancelled

    async def send(message):
        messages.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("198.18.0.11", 40000), "server": ("testserver", 80),
    }
    # As Django's test client does: the test's transaction must survive the request.
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        async_to_sync(ASGIHandler())(scope, receive, send)
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)
    start = messages[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, messages[1:]


def test_under_asgi_the_image_streams_piece_by_piece_without_being_read_whole_first(image, token, data, monkeypatch):
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: reads.append(n) or real_pread(fd, n, at))
    reads_before_first_byte = []

    original_send = ASGIHandler.send_response

    async def watching_send_response(self, response, send):
        async def watch(message):
            if message["type"] == "http.response.body" and not reads_before_first_byte:
                reads_before_first_byte.append(len(reads))
            await send(message)

        await original_send(self, response, watch)

    monkeypatch.setattr(ASGIHandler, "send_response", watching_send_response)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Django warns when it has to buffer a sync iterator
        status, headers, messages = asgi_get(url(image), {"Authorization": f"Bearer {token}", "Range": "bytes=5-"})

    assert status == 206
    assert headers["Content-Length"] == str(image.size_bytes - 5)
    assert b"".join(m.get("body", b"") for m in messages) == data[5:]
    assert max(reads) <= agent_views.PIECE_SIZE and len(reads) == 4
    assert reads_before_first_byte == [1]  # the first piece left before the second was read
