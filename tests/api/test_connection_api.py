"""Reaching a cluster over the API: ``connection`` in GET /api/clusters/<id>/, a node-login certificate from
POST /api/clusters/<id>/ssh-certificates/, and one's own keys at /api/profile/keys/."""
import logging
from datetime import datetime

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.serialization import load_ssh_public_identity
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from clusters.choices import ClusterState, MemberState
from console import roles
from console.models import AuditEntry
from machines import ssh_rules
from machines.models import Machine, SSHCertificate, UserPublicKey
from tests.builders import build, cluster_of, gpu_machine
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

OPERATOR_NOT_ALLOWED = ("Your role is Operator and node logins are not allowed for you yet: "
                        "an Administrator can allow them.")
VIEWER_REFUSED = ("Your role is Viewer: logging in to a node needs an Administrator, "
                  "or an Operator an Administrator allowed node logins.")


@pytest.fixture(autouse=True)
def ca_path(settings, tmp_path):
    """The certificate authority's key in this test's own directory, certificates valid an hour."""
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "ssh" / "ca_ed25519"
    settings.FADEN_SSH_CERT_SECONDS = 3600
    settings.FADEN_MACHINES_REACHABLE = True
    settings.FADEN_SSH_JUMP = ""
    return settings.FADEN_SSH_CA_KEY_PATH


def ed25519_line(comment: str = "alice@laptop") -> str:
    public = ed25519.Ed25519PrivateKey.generate().public_key()
    return public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode() + f" {comment}"


@pytest.fixture
def room():
    """gpu-room, running: gpu-a leads with 8 GPUs, gpu-b has 4; the machines are reached at 198.18.0.x."""
    return cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12, accelerators=4)], runtime=build("2.1.0"))


def client_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def certify(client, cluster, **body):
    return client.post(f"/api/clusters/{cluster.pk}/ssh-certificates/", body, format="json")


def machine_id(name: str) -> int:
    return Machine.objects.get(name=name).pk


# -- connection in the detail ------------------------------------------------------------------------


def test_the_detail_gives_every_node_with_its_ssh_command_once_every_machine_is_up(api_client, room):
    body = api_client.get(f"/api/clusters/{room.pk}/").json()

    assert body["connection_reason"] == ""
    nodes = body["connection"]["nodes"]
    assert [(n["rank"], n["name"], n["machine"], n["address"], n["gpus"]) for n in nodes] == [
        (0, "node-0", "gpu-a", "198.18.1.11", 8), (1, "node-1", "gpu-b", "198.18.1.12", 4)]
    assert [n["ssh_command"] for n in nodes] == ["ssh root@198.18.0.11", "ssh root@198.18.0.12"]
    assert nodes[1]["machine_id"] == machine_id("gpu-b") and nodes[1]["interface"] == "eth1"
    assert nodes[1]["host_key_fingerprint"] == Machine.objects.get(name="gpu-b").host_key_fingerprint != ""
    assert body["connection"]["head_address"] == "198.18.1.11" and body["connection"]["master_port"] == 29500


def test_the_snippets_carry_the_clusters_own_addresses_and_the_ray_tunnel(api_client, room):
    snippets = api_client.get(f"/api/clusters/{room.pk}/").json()["connection"]["snippets"]

    assert snippets["ray_tunnel"] == "ssh -N -L 8265:127.0.0.1:8265 -L 10001:127.0.0.1:10001 root@198.18.0.11"
    assert "--master_addr 198.18.1.11 --master_port 29500" in snippets["deepspeed"]
    assert "-np 12 --mca btl_tcp_if_include 198.18.1.0/24" in snippets["mpirun"]
    assert snippets["torchrun"].startswith("for node in node-0 node-1; do ssh")
    assert "--rdzv-id=gpu-room" in snippets["torchrun_node"]
    assert snippets["ray_job_submit"].startswith("ray job submit --address http://127.0.0.1:8265")
    assert snippets["ssh_commands"] == {"node-0": "ssh root@198.18.0.11", "node-1": "ssh root@198.18.0.12"}


def test_the_detail_says_which_machine_it_waits_for_while_one_is_not_up(api_client, room):
    room.members.filter(machine__name="gpu-b").update(state=MemberState.IMAGE)

    body = api_client.get(f"/api/clusters/{room.pk}/").json()

    assert body["connection"] is None
    assert body["connection_reason"] == "Waiting for gpu-b to be Up: it is getting the runtime image."


def test_a_stopped_cluster_has_no_connection_and_says_it_is_stopped(api_client):
    stopped = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], state=ClusterState.STOPPED)

    body = api_client.get(f"/api/clusters/{stopped.pk}/").json()

    assert body["connection"] is None
    assert body["connection_reason"].startswith("gpu-room is stopped: the nodes and their commands appear once it runs")


def test_the_list_leaves_connection_out_and_finds_a_cluster_by_name(api_client, room):
    cluster_of([gpu_machine("gpu-c", 13)], name="other-room")

    found = api_client.get("/api/clusters/", {"name": "gpu-room"}).json()["results"]

    assert [c["name"] for c in found] == ["gpu-room"]
    assert "connection" not in found[0]


def test_with_the_machines_not_reachable_every_ssh_command_jumps_through_the_console_host(api_client, room, settings):
    settings.FADEN_MACHINES_REACHABLE = False
    settings.FADEN_SSH_JUMP = "me@console.example.com:2222"

    connection = api_client.get(f"/api/clusters/{room.pk}/").json()["connection"]

    assert connection["jump"] == "me@console.example.com:2222"
    assert connection["nodes"][1]["ssh_command"] == "ssh -J me@console.example.com:2222 root@198.18.0.12"
    assert " -J me@console.example.com:2222 root@198.18.0.11" in connection["snippets"]["ray_tunnel"]


# -- a certificate ---------------------------------------------------------------------------------


def test_an_administrator_gets_a_certificate_for_every_node_of_the_cluster(api_client, room):
    key = ed25519_line()

    response = certify(api_client, room, public_key=key)

    assert response.status_code == 201, response.json()
    assert response["Cache-Control"].startswith("max-age=0") and "no-store" in response["Cache-Control"]
    body = response.json()
    signed = load_ssh_public_identity(body["certificate"].encode())
    assert signed.valid_principals == [f"fadenstack-cluster-{room.pk}".encode()]
    assert signed.key_id.decode() == body["key_id"] == f"fadenstack:admin:gpu-room:{body['serial']}"
    assert signed.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode() \
        == " ".join(key.split()[:2])
    assert datetime.fromisoformat(body["valid_before"]).timestamp() == signed.valid_before
    assert [n["name"] for n in body["nodes"]] == ["node-0", "node-1"]
    assert body["nodes"][1]["ssh_command"] == "ssh root@198.18.0.12"
    assert SSHCertificate.objects.get(pk=body["serial"]).principals == [f"fadenstack-cluster-{room.pk}"]


@pytest.mark.parametrize("node", ["node-1", 1, "1", "gpu-b"])
def test_a_certificate_for_one_node_names_that_machine_alone(api_client, room, node):
    body = certify(api_client, room, public_key=ed25519_line(), node=node).json()

    assert body["principals"] == [f"fadenstack-cluster-{room.pk}-machine-{machine_id('gpu-b')}"]
    assert [(n["name"], n["machine"], n["ssh_address"], n["ssh_port"], n["ssh_user"]) for n in body["nodes"]] == [
        ("node-1", "gpu-b", "198.18.0.12", 22, "root")]
    assert "node node-1 (gpu-b) of gpu-room" in body["message"]


def test_a_node_the_cluster_does_not_have_is_a_400_that_names_its_nodes_and_signs_nothing(api_client, room):
    response = certify(api_client, room, public_key=ed25519_line(), node="node-7")

    assert response.status_code == 400
    assert response.json()["message"] == "node: gpu-room has no node node-7: its nodes are node-0 to node-1, by name, rank or machine."
    assert not SSHCertificate.objects.exists()


@pytest.mark.parametrize("node", [True, [1], {"rank": 1}])
def test_a_node_that_is_neither_a_name_nor_a_rank_is_a_400(api_client, room, node):
    response = certify(api_client, room, public_key=ed25519_line(), node=node)

    assert response.status_code == 400
    assert response.json()["errors"]["node"] == ["A node is its name (node-1), its rank (1) or its machine's name."]


@pytest.mark.parametrize("pasted, sentence", [
    ("", ssh_rules.NO_KEY),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----", ssh_rules.PRIVATE_KEY),
    ("ssh-dss AAAAB3NzaC1kc3MAAACBAP== old@box", "Keys of type ssh-dss are not accepted"),
    ("not a key at all", ssh_rules.NOT_OPENSSH),
])
def test_a_bad_key_is_a_400_with_the_rules_sentence_and_signs_nothing(api_client, room, pasted, sentence):
    response = certify(api_client, room, public_key=pasted)

    assert response.status_code == 400
    assert response.json()["message"].startswith(f"public_key: {sentence}")
    assert not SSHCertificate.objects.exists()


def test_a_viewer_is_refused_with_the_rules_sentence_whatever_they_paste(room):
    viewer = client_for(UserFactory(username="vic", role=roles.VIEWER))

    for key in (ed25519_line(), "garbage"):
        response = certify(viewer, room, public_key=key)
        assert response.status_code == 403
        assert response.json() == {"message": VIEWER_REFUSED}
    assert not SSHCertificate.objects.exists()


def test_an_operator_is_refused_until_an_administrator_allows_node_logins(room):
    operator = UserFactory(username="olga", role=roles.OPERATOR)
    client = client_for(operator)

    refused = certify(client, room, public_key=ed25519_line())
    roles.node_logins_set(operator, True)
    allowed = certify(client, room, public_key=ed25519_line())

    assert refused.status_code == 403 and refused.json()["message"] == OPERATOR_NOT_ALLOWED
    assert allowed.status_code == 201 and allowed.json()["key_id"].startswith("fadenstack:olga:gpu-room:")


def test_a_cluster_not_every_machine_of_which_is_up_gets_no_certificate(api_client, room):
    room.members.filter(machine__name="gpu-b").update(state=MemberState.RAY)

    response = certify(api_client, room, public_key=ed25519_line())

    assert response.status_code == 400
    assert response.json()["message"] == "Waiting for gpu-b to be Up: it is starting Ray."
    assert not SSHCertificate.objects.exists()


def test_a_key_of_ones_profile_is_signed_by_its_name(api_client, admin_user, room):
    kept = UserPublicKey(user=admin_user, name="laptop", key=ed25519_line("ada@laptop"))
    kept.full_clean()
    kept.save()

    body = certify(api_client, room, key="laptop").json()
    unknown = certify(api_client, room, key="desktop")
    both = certify(api_client, room, key="laptop", public_key=ed25519_line())

    signed = load_ssh_public_identity(body["certificate"].encode())
    assert signed.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode() \
        == " ".join(kept.key.split()[:2])
    assert unknown.status_code == 400 and "You have no key named 'desktop' on your profile" in unknown.json()["message"]
    assert both.status_code == 400 and both.json()["errors"]["key"][0].startswith("Give public_key")


def test_the_certificate_is_in_no_log_record_and_not_in_the_audit_trail(api_client, room, caplog):
    caplog.set_level(logging.DEBUG)

    body = certify(api_client, room, public_key=ed25519_line()).json()

    blob = body["certificate"].split()[1]
    assert blob not in caplog.text
    assert any(body["key_id"] in record.getMessage() for record in caplog.records)  # the key id is logged
    entry = AuditEntry.objects.get(method="POST")
    assert body["key_id"] in entry.message and blob not in str(entry.__dict__)


def test_a_cluster_that_does_not_exist_is_a_404(api_client):
    response = api_client.post("/api/clusters/999/ssh-certificates/", {"public_key": ed25519_line()}, format="json")

    assert response.status_code == 404
    assert not SSHCertificate.objects.exists()


# -- one's own keys ----------------------------------------------------------------------------------


def test_profile_keys_are_listed_added_and_removed_for_their_owner_only(api_client, admin_user):
    key = ed25519_line("ada@laptop")

    added = api_client.post("/api/profile/keys/", {"name": "laptop", "key": key}, format="json")
    again = api_client.post("/api/profile/keys/", {"name": "desk", "key": key}, format="json")
    other = client_for(UserFactory(username="vic", role=roles.VIEWER))
    theirs = other.post("/api/profile/keys/", {"name": "laptop", "key": ed25519_line()}, format="json").json()

    assert added.status_code == 201 and added.json()["fingerprint"].startswith("SHA256:")
    assert again.status_code == 400 and again.json()["message"].endswith("You have added this key already, under another name.")
    assert [k["name"] for k in api_client.get("/api/profile/keys/").json()] == ["laptop"]
    assert api_client.delete(f"/api/profile/keys/{theirs['id']}/").status_code == 404
    assert api_client.delete(f"/api/profile/keys/{added.json()['id']}/").status_code == 204
    assert list(UserPublicKey.objects.values_list("user__username", flat=True)) == ["vic"]


def test_a_bad_profile_key_is_refused_with_the_rules_sentence(api_client):
    response = api_client.post("/api/profile/keys/", {"name": "laptop", "key": "ssh-rsa AAAA broken"}, format="json")

    assert response.status_code == 400
    assert response.json()["errors"]["key"] == [ssh_rules.NOT_OPENSSH]
    assert not UserPublicKey.objects.exists()


def test_the_schema_describes_connection_and_the_certificate_request(api_client):
    schema = api_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()

    assert "/api/clusters/{id}/ssh-certificates/" in schema["paths"]
    assert "/api/profile/keys/{id}/" in schema["paths"]
    detail = schema["components"]["schemas"]["ClusterDetail"]["properties"]
    assert {"connection", "connection_reason"} <= set(detail)
