"""The NCCL test over the API: POST /api/clusters/<id>/tests/ and its refusals (403, 400, 409 with the
rules' sentences), GET the list and one test, and ``last_test`` in the cluster's detail."""
from pathlib import Path

import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from clusters import nccl
from clusters.choices import MemberState
from clusters.models import NcclTest, NcclTestState
from clusters.runners.nccl import row_of
from console import roles
from deployments.choices import CopyState
from deployments.models import Copy
from tests.builders import cluster_of, deployment_of, gpu_machine
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nccl"


@pytest.fixture
def room():
    return cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)])


@pytest.fixture
def sweep(settings):
    settings.FADEN_NCCL_TEST_MAX_BYTES, settings.FADEN_NCCL_TEST_ITERS, settings.FADEN_NCCL_TEST_WARMUP = 64 * nccl.MiB, 2, 1
    return settings


def client_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def start(client, cluster, **body):
    return client.post(f"/api/clusters/{cluster.pk}/tests/", body, format="json")


def finished(cluster) -> NcclTest:
    run = nccl.parse_all_reduce((FIXTURES / "cscs-gh200-2.18.2.txt").read_text())
    return NcclTest.objects.create(cluster=cluster, state=NcclTestState.FINISHED, nodes=2, gpus=12, minbytes=nccl.MiB,
                                   maxbytes=128 * nccl.MiB, iters=20, warmup=5, rows=[row_of(r) for r in run.rows],
                                   avg_busbw=run.avg_busbw, message="Peak 22.88 GB/s at 128 MiB, average 15.00 GB/s over 8 sizes.")


def test_a_start_answers_201_with_the_running_test_and_its_job(api_client, admin_user, room, sweep, queued):
    answer = start(api_client, room)
    assert answer.status_code == 201, answer.json()
    body = answer.json()
    assert {k: body[k] for k in ("cluster", "state", "message", "nodes", "gpus", "minbytes", "maxbytes", "iters", "rows", "peak")} == {
        "cluster": room.pk, "state": "running", "message": "", "nodes": 2, "gpus": 16, "minbytes": nccl.MiB,
        "maxbytes": 64 * nccl.MiB, "iters": 2, "rows": [], "peak": None}
    assert body["started_by"] == admin_user.username
    assert body["job"] == NcclTest.objects.get().job_id and body["job"] is not None


def test_a_second_start_is_a_409_naming_the_running_test(api_client, room, sweep, queued):
    first = start(api_client, room).json()
    answer = start(api_client, room, confirm=True)
    assert answer.status_code == 409
    when = timezone.localtime(NcclTest.objects.get(pk=first["id"]).started_at)
    sentence = f"An NCCL test is already running on gpu-room (started {when:%H:%M} by {first['started_by']})."
    assert answer.json() == {"message": sentence, "detail": sentence, "confirm": False}


def test_serving_copies_are_a_409_until_the_start_confirms(api_client, room, sweep, queued):
    deployment = deployment_of(room)
    for number in (1, 2, 3):
        Copy.objects.create(deployment=deployment, number=number, state=CopyState.SERVING, address="198.18.1.11", port=8100 + number)
    refused = start(api_client, room, confirm=False)
    assert refused.status_code == 409
    assert refused.json()["detail"] == ("3 copies are serving on gpu-room's GPUs: the test uses every GPU and slows them. "
                                        "Send confirm: true to run it anyway.")
    assert refused.json()["confirm"] is True and not NcclTest.objects.exists()
    assert start(api_client, room, confirm=True).status_code == 201


def test_a_cluster_not_every_machine_of_which_is_up_is_a_400_with_the_connect_cards_sentence(api_client, room, sweep):
    room.members.filter(machine__name="gpu-b").update(state=MemberState.FAILED)
    answer = start(api_client, room)
    assert answer.status_code == 400
    assert answer.json()["message"] == "Waiting for gpu-b to be Up: it did not join."


def test_a_viewer_reads_the_tests_but_may_not_start_one(room, sweep):
    finished(room)
    viewer = client_for(UserFactory(username="vic", role=roles.VIEWER))
    refused = start(viewer, room)
    assert refused.status_code == 403
    assert refused.json()["message"] == "Your role is Viewer: running the NCCL test needs an Operator."
    assert viewer.get(f"/api/clusters/{room.pk}/tests/").json()["count"] == 1


def test_an_operator_may_start_one(room, sweep, queued):
    operator = client_for(UserFactory(username="olga", role=roles.OPERATOR))
    assert start(operator, room).json()["started_by"] == "olga"


def test_the_list_is_newest_first_and_one_test_reads_with_its_rows_and_peak(api_client, room, sweep, queued):
    old = finished(room)
    new = start(api_client, room).json()
    listed = api_client.get(f"/api/clusters/{room.pk}/tests/").json()
    assert [t["id"] for t in listed["results"]] == [new["id"], old.pk]

    one = api_client.get(f"/api/clusters/{room.pk}/tests/{old.pk}/").json()
    assert one["state"] == "finished" and len(one["rows"]) == 8
    assert one["rows"][0] == {"size_bytes": nccl.MiB, "time_us": 335.85, "algbw": 3.12, "busbw": 3.12}
    assert one["peak"] == {"size_bytes": 128 * nccl.MiB, "busbw": 22.88}
    assert one["avg_busbw"] == pytest.approx(14.9966)
    assert one["message"] == "Peak 22.88 GB/s at 128 MiB, average 15.00 GB/s over 8 sizes."


def test_another_clusters_test_is_not_found_under_this_one(api_client, room):
    other = cluster_of([gpu_machine("gpu-x", 21)], name="other-room")
    theirs = finished(other)
    answer = api_client.get(f"/api/clusters/{room.pk}/tests/{theirs.pk}/")
    assert answer.status_code == 404
    assert answer.json()["message"] == f"gpu-room has no NCCL test {theirs.pk}."


@pytest.mark.parametrize("test_id", ["0", str(2**63), "9" * 19])
def test_a_test_id_outside_the_keys_range_is_not_found_as_the_schema_says(api_client, room, test_id):
    answer = api_client.get(f"/api/clusters/{room.pk}/tests/{test_id}/")
    assert answer.status_code == 404, answer.content


def test_the_detail_gives_the_last_test_or_null(api_client, room, sweep, queued):
    assert api_client.get(f"/api/clusters/{room.pk}/").json()["last_test"] is None
    finished(room)
    newest = start(api_client, room).json()
    assert api_client.get(f"/api/clusters/{room.pk}/").json()["last_test"] == newest


@pytest.mark.parametrize("confirm", [0, 1, "true", "yes", None])
def test_confirm_is_true_or_false_as_json_writes_them(api_client, room, sweep, confirm):
    answer = start(api_client, room, confirm=confirm)
    assert answer.status_code == 400
    assert answer.json()["message"] == ("confirm: This field may not be null." if confirm is None else "confirm: Must be true or false.")
    assert not NcclTest.objects.exists()
