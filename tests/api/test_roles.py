"""Every action, by page and by API, against every role: the role it needs does it, every role below
is refused with a 403 whose sentence names both, and a refusal changes nothing.

Tasks are never run here: what the services leave for after commit (the jobs' tasks, the checks)
is only counted, as a sign that the action went ahead. Reaching a machine over SSH (the host key
scan of Add a machine) answers from ``machine_offers``.
"""
import re
from dataclasses import dataclass
from html import unescape

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from clusters import actions as cluster_actions
from clusters.choices import ClusterState
from clusters.models import Cluster, ClusterMember
from console import roles
from console.models import Job
from console.roles import ADMINISTRATOR, MANAGE_USERS, OPERATOR, VIEWER, Action
from machines import actions as machine_actions
from machines.models import Machine
from tests.builders import NETWORK, build, cluster_of, gpu_machine
from tests.factories import NO_ROLE, MachineFactory, UserFactory

pytestmark = pytest.mark.django_db

MANAGEMENT = "198.18.0.0/24"  # the other network every machine of the world shares


@dataclass
class World:
    room: int  # running: gpu-a (head), gpu-b
    parked: int  # stopped, on the older build with a newer one certified: gpu-d (head), gpu-e
    waiting: int  # waits for a person: gpu-f
    free: int  # gpu-c, in no cluster
    spare: int  # gpu-g, in no cluster
    awaiting_key: int  # added, its host key not yet trusted
    offered: str  # the key it offers
    scanned: str  # the key any other address offers (Add a machine)
    someone: int  # another user, a Viewer


@pytest.fixture
def world(machine_offers, offered_fingerprint) -> World:
    older = build("2.1.0")
    build("2.2.0")
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=older)
    parked = cluster_of([gpu_machine("gpu-d", 14), gpu_machine("gpu-e", 15)], runtime=older, name="parked",
                        state=ClusterState.STOPPED)
    waiting = cluster_of([gpu_machine("gpu-f", 16)], runtime=older, name="waiting", state=ClusterState.WAITING)
    awaiting = MachineFactory(awaiting_host_key=True)
    return World(room=room.pk, parked=parked.pk, waiting=waiting.pk, free=gpu_machine("gpu-c", 13).pk,
                 spare=gpu_machine("gpu-g", 17).pk, awaiting_key=awaiting.pk,
                 offered=awaiting.offered_host_key_fingerprint, scanned=offered_fingerprint, someone=UserFactory(username="someone", role=VIEWER).pk)


@dataclass(frozen=True)
class Case:
    """One action: who may do it, the page's POST and the API's call (either may be absent)."""

    name: str
    action: Action
    page: tuple[str, dict] | None = None  # (URL, form) of a POST, with {w.free}-style fields
    api: tuple[str, str, dict] | None = None  # (method, URL, JSON body)


def member_of(cluster_pk: int) -> int:
    return ClusterMember.objects.filter(cluster_id=cluster_pk).order_by("machine__name").last().machine_id


CASES = [
    Case("create a cluster", cluster_actions.CREATE,
         page=("/clusters/new/create/", {"name": "new-room", "machines": "{free},{spare}", "head": "{free}", "network": NETWORK}),
         api=("post", "/api/clusters/", {"name": "new-room", "machines": ["{free}", "{spare}"], "head": "{free}", "network": NETWORK})),
    Case("test networks", cluster_actions.TEST_NETWORKS,
         page=("/clusters/new/probe/", {"name": "new-room", "machines": "{free},{spare}", "head": "{free}"}),
         api=("post", "/api/clusters/networks/", {"machines": ["{free}", "{spare}"], "head": "{free}"})),
    Case("test a cluster's networks", cluster_actions.TEST_NETWORKS, page=("/clusters/{room}/network/test/", {})),
    Case("check now", cluster_actions.CHECK, page=("/clusters/{room}/check/", {}), api=("post", "/api/clusters/{room}/check/", {})),
    Case("stop", cluster_actions.STOP, page=("/clusters/{room}/stop/", {}), api=("post", "/api/clusters/{room}/stop/", {})),
    Case("start", cluster_actions.START, page=("/clusters/{parked}/start/", {}), api=("post", "/api/clusters/{parked}/start/", {})),
    Case("try again", cluster_actions.RETRY, page=("/clusters/{waiting}/retry/", {}), api=("post", "/api/clusters/{waiting}/retry/", {})),
    Case("add machines", cluster_actions.ADD, page=("/clusters/{room}/add/", {"machines": "{free}"}),
         api=("post", "/api/clusters/{room}/machines/", {"machines": ["{free}"]})),
    Case("remove a machine", cluster_actions.REMOVE, page=("/clusters/{parked}/machines/{parked_member}/remove/", {}),
         api=("delete", "/api/clusters/{parked}/machines/{parked_member}/", {})),
    Case("switch the runtime", cluster_actions.SWITCH, page=("/clusters/{parked}/runtime/switch/", {}),
         api=("post", "/api/clusters/{parked}/switch-runtime/", {})),
    Case("change the network", cluster_actions.NETWORK, page=("/clusters/{parked}/network/", {"network": MANAGEMENT}),
         api=("post", "/api/clusters/{parked}/change-network/", {"network": MANAGEMENT})),
    Case("delete a cluster", cluster_actions.DELETE, page=("/clusters/{parked}/delete/", {}), api=("delete", "/api/clusters/{parked}/", {})),
    Case("add a machine", machine_actions.ADD,
         page=("/machines/add/", {"step": "confirm", "name": "gpu-new", "address": "198.18.0.99", "ssh_port": "22", "ssh_user": "root",
                                  "host_key_fingerprint": "{scanned}"}),
         api=("post", "/api/machines/", {"name": "gpu-new", "address": "198.18.0.99"})),
    Case("refresh facts", machine_actions.REFRESH, page=("/machines/{free}/refresh/", {}), api=("post", "/api/machines/{free}/refresh/", {})),
    Case("update the agent", machine_actions.UPDATE_AGENT, page=("/machines/{free}/update-agent/", {}),
         api=("post", "/api/machines/{free}/update-agent/", {})),
    Case("trust a host key", machine_actions.TRUST, page=("/machines/{awaiting_key}/trust-host-key/", {"fingerprint": "{offered}"}),
         api=("post", "/api/machines/{awaiting_key}/trust-host-key/", {"fingerprint": "{offered}"})),
    Case("choose a machine's container runtime", machine_actions.CHOOSE_RUNTIME,
         page=("/machines/{free}/runtime/", {"runtime_choice": "docker"}),
         api=("patch", "/api/machines/{free}/", {"runtime_choice": "docker"})),
    Case("delete a machine", machine_actions.DELETE, page=("/machines/{spare}/delete/", {}), api=("delete", "/api/machines/{spare}/", {})),
    Case("add a user", MANAGE_USERS, page=("/users/add/", {"username": "newcomer", "password": "a-long-enough-passphrase", "role": "Viewer"})),
    Case("change a user's role", MANAGE_USERS, page=("/users/{someone}/role/", {"role": "Operator"})),
    Case("deactivate a user", MANAGE_USERS, page=("/users/{someone}/active/", {"active": "false"})),
]
ROLES = [None, VIEWER, OPERATOR, ADMINISTRATOR]


def filled(value, w: World):
    """A case's URL or field with the world's ids in it; a lone "{id}" in a JSON list becomes a number."""
    fields = {**vars(w), "parked_member": member_of(w.parked)}
    if isinstance(value, dict):
        return {key: filled(item, w) for key, item in value.items()}
    if isinstance(value, list):
        return [filled(item, w) for item in value]
    if isinstance(value, str) and "{" in value:
        text = value.format(**fields)
        return int(text) if value.startswith("{") and value.endswith("}") and text.isdigit() else text
    return value


def everything() -> dict:
    """What a refusal must leave alone: every cluster, member, machine, job and user, and the roles."""
    User = get_user_model()
    return {
        "clusters": list(Cluster.objects.order_by("pk").values("pk", "state", "network", "runtime_version")),
        "members": list(ClusterMember.objects.order_by("pk").values("pk", "cluster", "machine", "role", "runtime_image")),
        "machines": list(Machine.objects.order_by("pk").values("pk", "state", "host_key_fingerprint", "runtime_choice")),
        "jobs": Job.objects.count(),
        "users": list(User.objects.order_by("pk").values("pk", "username", "is_active", "is_superuser")),
        "groups": sorted(User.groups.through.objects.values_list("user_id", "group_id")),
    }


def user_with(role):
    return UserFactory(username=f"as-{role or 'nobody'}".lower(), role=role or NO_ROLE)


def expected_refusal(case: Case, role) -> str:
    """No role is turned away before any action; a role below the action's gets the action's sentence."""
    return roles.NO_ROLE if role is None else case.action.offer(role).why


def allowed(case: Case, role) -> bool:
    return role is not None and role.rank >= case.action.needs.rank


def label(role) -> str:
    return str(role or "no role")


@pytest.mark.parametrize("role", ROLES, ids=label)
@pytest.mark.parametrize("case", [c for c in CASES if c.page], ids=lambda c: c.name)
def test_each_pages_button_does_its_action_for_the_role_it_needs_and_is_refused_below_it(
    world, case, role, django_capture_on_commit_callbacks
):
    client = Client()
    client.force_login(user_with(role))
    url, form = case.page
    before = everything()

    with django_capture_on_commit_callbacks() as after_commit:
        response = client.post(filled(url, world), filled(form, world))

    if allowed(case, role):
        assert response.status_code == 302, unescape(response.content.decode())[:2000]
        assert everything() != before or after_commit
    else:
        assert response.status_code == 403
        assert expected_refusal(case, role) in unescape(response.content.decode())
        assert (everything(), after_commit) == (before, [])


@pytest.mark.parametrize("role", ROLES, ids=label)
@pytest.mark.parametrize("case", [c for c in CASES if c.api], ids=lambda c: c.name)
def test_each_api_call_does_its_action_for_the_role_it_needs_and_is_a_403_with_the_sentence_below_it(
    world, case, role, django_capture_on_commit_callbacks
):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user_with(role)).key}")
    method, url, body = case.api
    before = everything()

    with django_capture_on_commit_callbacks() as after_commit:
        response = getattr(client, method)(filled(url, world), filled(body, world), format="json")

    if allowed(case, role):
        assert response.status_code in (200, 201, 202, 204), response.content
        assert everything() != before or after_commit
    else:
        assert response.status_code == 403
        assert response.json() == {"message": expected_refusal(case, role)}
        assert (everything(), after_commit) == (before, [])


def test_every_action_a_role_guards_is_in_the_matrix():
    """A new Action in clusters/actions.py or machines/actions.py must be added to CASES (deploying
    waits for deployments, deciding engine options is part of a deploy; Check now and Test networks are the same Actions on other pages)."""
    declared = {value for module in (cluster_actions, machine_actions) for value in vars(module).values() if isinstance(value, Action)}
    # Deciding engine options is checked inside a deploy (tests/unit/test_engine_options.py), not as a request of its own.
    assert declared - {c.action for c in CASES} == {cluster_actions.DEPLOY, cluster_actions.DECIDE_ENGINE_OPTIONS}


@pytest.mark.parametrize("case", [c for c in CASES if c.api], ids=lambda c: c.name)
def test_the_schema_lists_the_403_a_role_below_each_api_call_gets(api_client, case):
    """The fuzzer holds every answer to the schema: a role's refusal must be one the schema describes."""
    schema = api_client.get("/api/schema/?format=json").json()
    method, url, _ = case.api
    pattern = re.compile(re.sub(r"\\\{[^}]+\\\}", r"\\{[^}]+\\}", re.escape(url)) + "$")
    [path] = [path for path in schema["paths"] if pattern.match(path)]

    refused = schema["paths"][path][method]["responses"]["403"]
    assert refused["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
