"""Bad input to the API and the machines' heartbeat: a refusal in JSON with a readable ``message``
(400, or 404, 405, 413 where HTTP says so), never a 500 or an HTML page, and nothing stored."""
import hashlib
import json

import pytest
from django.test import Client

from clusters.models import Cluster, ClusterMember
from console import bodies
from console.models import Job
from machines.models import Machine
from tests.builders import NETWORK, build, cluster_of, gpu_machine
from tests.factories import MachineFactory

pytestmark = pytest.mark.django_db

BEYOND_BIGINT = 2**63
DEEP = "[" * 5000 + "]" * 5000  # past Python's recursion limit: it raised RecursionError, a 500
TOO_DEEP = "[" * 33 + "]" * 33  # one level past the console's limit


@pytest.fixture
def machines():
    return [gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)]


@pytest.fixture
def room(machines):
    return cluster_of(machines[:2], runtime=build("2.1.0"))


@pytest.fixture
def nothing_changes(django_capture_on_commit_callbacks):
    """After the test: no machine, cluster, member or job more than before, and nothing sent after commit."""
    counts = lambda: [model.objects.count() for model in (Machine, Cluster, ClusterMember, Job)]  # noqa: E731
    before = counts()
    with django_capture_on_commit_callbacks() as sent:
        yield
    assert counts() == before
    assert sent == []


def refusal(response, status: int = 400) -> str:
    """The message of a JSON refusal with ``status``."""
    assert response.status_code == status, response.content[:500]
    assert response["Content-Type"] == "application/json"
    return response.json()["message"]


def post_json(client, url: str, text: str):
    return client.generic("POST", url, text, content_type="application/json")


# -- bodies: depth, size, form ------------------------------------------------------------------------


@pytest.mark.parametrize("body", [DEEP, TOO_DEEP, json.dumps({"name": "gpu-room", "machines": json.loads(TOO_DEEP)})])
@pytest.mark.parametrize("url", ["/api/clusters/", "/api/machines/", "/api/clusters/networks/"])
def test_json_nested_deeper_than_32_levels_is_a_400_that_says_so(api_client, nothing_changes, url, body):
    message = refusal(post_json(api_client, url, body))
    assert message == "The JSON body nests deeper than 32 levels of lists and objects."


def test_json_nested_up_to_32_levels_is_read_and_answered_field_by_field(api_client, nothing_changes):
    within = "[" * 31 + "]" * 31
    body = json.dumps({"name": "gpu-room", "machines": json.loads(within), "network": NETWORK})
    assert refusal(post_json(api_client, "/api/clusters/", body)).startswith("machines: ")


def test_a_body_larger_than_the_console_reads_is_a_413_with_a_message(api_client, settings, nothing_changes):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = json.dumps({"name": "gpu-a", "address": "198.18.0.11", "padding": "x" * 2000})
    assert refusal(post_json(api_client, "/api/machines/", body), 413) == (
        "The request body is larger than the 1,000 bytes the console accepts.")


@pytest.mark.parametrize("text", ["not json", '{"name": NaN}', b"\xff\xfe"])
def test_a_body_that_is_not_json_is_a_400_that_says_so(api_client, nothing_changes, text):
    assert refusal(post_json(api_client, "/api/machines/", text)).startswith("The body is not JSON")


def test_a_form_body_is_a_415_that_names_the_media_type(api_client, nothing_changes):
    response = api_client.post("/api/machines/", {"name": "gpu-a", "address": "198.18.0.11"}, format="multipart")
    assert "multipart/form-data" in refusal(response, 415)


# -- ids in bodies, queries and paths -----------------------------------------------------------------


BAD_IDS = [BEYOND_BIGINT, "١٢", "²", "9" * 5000, True, 1.5, "12abc", -3, 0, None]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_a_bad_machine_id_in_a_cluster_to_create_is_a_400_and_nothing_is_stored(api_client, machines, nothing_changes, bad):
    body = {"name": "gpu-room", "machines": [machines[0].pk, bad], "network": NETWORK}
    message = refusal(api_client.post("/api/clusters/", body, format="json"))
    assert message.startswith("machines: ")
    assert "Give a whole number from 1 to 9,223,372,036,854,775,807" in message or "may not be null" in message


@pytest.mark.parametrize("bad", [BEYOND_BIGINT, "١", "9" * 5000])
def test_a_bad_head_or_machine_id_elsewhere_in_a_body_is_a_400(api_client, room, machines, nothing_changes, bad):
    ids = [m.pk for m in machines]
    for url, body in [("/api/clusters/", {"name": "x", "machines": ids, "head": bad, "network": NETWORK}),
                      ("/api/clusters/networks/", {"machines": ids, "head": bad}),
                      ("/api/clusters/networks/", {"machines": [*ids, bad]}),
                      (f"/api/clusters/{room.pk}/machines/", {"machines": [bad]})]:
        assert "Give a whole number" in refusal(api_client.post(url, body, format="json")), url


def test_more_ids_than_a_console_holds_are_a_400(api_client, nothing_changes):
    message = refusal(api_client.post("/api/clusters/networks/", {"machines": list(range(1, 5003))}, format="json"))
    assert message == "machines: Ensure this field has no more than 5000 elements."


@pytest.mark.parametrize("query", ["machines=١,٢", f"machines=1,{BEYOND_BIGINT}", "machines=1,2&head=²",
                                   "machines=" + "9" * 5000, "machines=1,x", "machines=1,2&head=1&head=2"])
def test_bad_ids_in_the_networks_query_are_a_400_that_names_the_parameter(api_client, machines, query):
    message = refusal(api_client.get(f"/api/clusters/networks/?{query}"))
    assert message.startswith(("machines: Give", "head: Give"))


@pytest.mark.parametrize("url", ["/api/machines/?page=٣", "/api/machines/?page=" + "9" * 5000, "/api/clusters/?page=0",
                                 "/api/machines/?page=-1", "/api/machines/?page=1&page=2"])
def test_a_page_that_is_not_a_number_from_1_is_a_400(api_client, url):
    assert refusal(api_client.get(url)).startswith("page: Give")


def test_a_page_past_the_last_is_a_404_with_a_message(api_client):
    assert refusal(api_client.get(f"/api/machines/?page={BEYOND_BIGINT - 1}"), 404) == "Invalid page."


def test_join_candidates_refuse_a_page_that_is_not_a_number(api_client, room):
    assert refusal(api_client.get(f"/api/clusters/{room.pk}/join-candidates/?page=²")).startswith("page: Give")


def test_a_nul_in_search_words_is_a_400_not_a_postgresql_error(api_client, room, admin_client):
    for url in [f"/api/clusters/{room.pk}/join-candidates/?q=gpu%00", f"/api/clusters/{room.pk}/join-candidates/?kind=%00",
                "/api/audit/?user=%00", "/api/audit/?action=a%00"]:
        assert refusal(api_client.get(url)).endswith(": Give text without NUL characters."), url
    for url in ["/machines/?q=%00", "/clusters/new/?step=machines&q=%00", "/audit/?user=%00"]:
        assert admin_client.get(url).status_code == 400, url


@pytest.mark.parametrize("url", [f"/api/machines/{BEYOND_BIGINT}/", f"/api/clusters/{10**30}/", "/api/machines/١/",
                                 "/api/machines/abc/"])
def test_an_id_in_a_path_that_no_object_can_have_is_a_404_in_json(api_client, url):
    assert refusal(api_client.get(url), 404)


def test_removing_a_machine_whose_id_is_past_the_database_range_is_a_400(api_client, room, nothing_changes):
    message = refusal(api_client.delete(f"/api/clusters/{room.pk}/machines/{BEYOND_BIGINT}/"))
    assert message.startswith("machine_id: Give a whole number")


# -- unknown ids are named ------------------------------------------------------------------------------


def test_a_network_test_naming_machines_that_do_not_exist_is_a_400_naming_them_and_starts_nothing(
        api_client, machines, nothing_changes):
    response = api_client.post("/api/clusters/networks/", {"machines": [machines[0].pk, 987654, 987655]}, format="json")
    assert refusal(response) == "machines: No machine has the id 987654, 987655."


def test_a_cluster_naming_machines_that_do_not_exist_is_a_400_naming_them(api_client, machines, nothing_changes):
    body = {"name": "gpu-room", "machines": [machines[0].pk, 987654], "head": machines[0].pk, "network": NETWORK}
    assert refusal(api_client.post("/api/clusters/", body, format="json")) == "machines: No machine has the id 987654."


# -- errors outside the views: 404, 405, 500 ------------------------------------------------------------


def test_a_url_under_api_that_matches_nothing_is_a_404_in_json(api_client):
    assert refusal(api_client.get("/api/nothing-here/"), 404) == "There is no such API endpoint: /api/nothing-here/"


@pytest.mark.parametrize(("method", "url"), [("put", "/api/machines/"), ("patch", "/api/clusters/"),
                                             ("get", "/api/clusters/1/stop/")])
def test_a_method_an_endpoint_does_not_take_is_a_405_in_json(api_client, method, url):
    assert "not allowed" in refusal(getattr(api_client, method)(url), 405)


def test_a_crash_in_the_api_is_a_500_in_json_without_a_traceback(admin_user, monkeypatch):
    from machines.api import MachineViewSet

    monkeypatch.setattr(MachineViewSet, "get_queryset", lambda self: 1 / 0)
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)
    response = client.get("/api/machines/")
    assert refusal(response, 500) == "Something went wrong on the console; the error is in its log."
    assert b"ZeroDivisionError" not in response.content


# -- the heartbeat: the token before the body ------------------------------------------------------------


TOKEN = "the-token-this-machine-was-given-at-enrolment"


@pytest.fixture
def beating_machine():
    return MachineFactory(heartbeat_token_hash=hashlib.sha256(TOKEN.encode()).hexdigest())


def heartbeat(body: str, token: str | None = TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return Client(enforce_csrf_checks=True).post("/agent/heartbeat/", body, content_type="application/json", headers=headers)


@pytest.mark.parametrize("token", [None, "someone-elses-token"])
def test_a_heartbeat_without_a_machines_token_is_a_401_and_its_body_is_never_parsed(beating_machine, monkeypatch, token):
    parsed = []
    monkeypatch.setattr(bodies, "json_loads", lambda raw: parsed.append(raw))

    assert heartbeat(DEEP, token).status_code == 401
    assert parsed == []


def test_a_heartbeat_nested_too_deep_is_a_400_and_the_machine_is_not_seen(beating_machine):
    before = beating_machine.last_seen
    response = heartbeat(DEEP)
    assert response.status_code == 400
    assert response.json()["error"] == "The JSON body nests deeper than 32 levels of lists and objects."
    beating_machine.refresh_from_db()
    assert beating_machine.last_seen == before


def test_a_heartbeat_larger_than_16_kib_is_a_413(beating_machine):
    response = heartbeat(json.dumps({"agent_version": "0.1.0", "padding": "x" * 20_000}))
    assert response.status_code == 413
    assert response.json()["error"] == "The request body is larger than the 16,384 bytes the console accepts."


def test_a_heartbeat_whose_json_is_not_an_object_is_read_as_an_empty_one(beating_machine):
    assert heartbeat("[1, 2]").json()["ok"] is True


# -- the audit trail's filters ------------------------------------------------------------------------


def test_an_audit_outcome_that_is_not_one_of_the_outcomes_is_a_400_naming_them(api_client, admin_client):
    message = refusal(api_client.get("/api/audit/?outcome=AAA"))
    assert message == "outcome: Give one of done, shown, refused, failed, not 'AAA'."
    page = admin_client.get("/audit/?outcome=AAA")
    assert page.status_code == 400 and b"outcome: Give one of done, shown, refused, failed" in page.content


def test_an_audit_entry_is_read_by_its_id_whatever_the_lists_filters_say(api_client):
    entry_id = api_client.get("/api/audit/").json()["results"][0]["id"]
    assert api_client.get(f"/api/audit/{entry_id}/?outcome=AAA").status_code == 200
