"""Node logins taken back (clusters/node_logins.py): every certificate recorded with its cluster, the key
revocation list (checked by ssh-keygen where installed), an Administrator's Take back (page, API, audit), the
user changes that take a person's certificates back by themselves, and the push to the cluster's machines."""
import base64
import shutil
import subprocess

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.contrib.auth.models import Group
from django.db import transaction

from clusters import node_logins
from clusters.connection_info import node_login_certificate
from clusters.models import NodeCertificate
from console import roles
from console.models import AuditEntry
from machines import ssh_ca, ssh_krl
from machines.choices import MachineState
from machines.models import Machine
from tests.builders import build, cluster_of, gpu_machine
from tests.factories import UserFactory
from tests.fakes import FakeAgents

HAS_SSH_KEYGEN = shutil.which("ssh-keygen") is not None
# A revocation pushes the list once its transaction commits: the tests run those callbacks (on_commit below).
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def ca_path(settings, tmp_path):
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "ssh" / "ca_ed25519"
    settings.FADEN_SSH_CERT_SECONDS = 3600
    settings.FADEN_MACHINES_REACHABLE = True
    settings.FADEN_SSH_JUMP = ""


@pytest.fixture
def room():
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)], runtime=build("2.1.0"))


@pytest.fixture
def on_commit(django_capture_on_commit_callbacks):
    return django_capture_on_commit_callbacks


@pytest.fixture
def agents(monkeypatch):
    return FakeAgents().install(monkeypatch)


def key_line() -> str:
    public = ed25519.Ed25519PrivateKey.generate().public_key()
    return public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode() + " ada@laptop"


def sign(user, cluster, node=None):
    return node_login_certificate(user=user, cluster=cluster, public_key=key_line(), node=node).issued


def pushes(agents) -> list[tuple[str, str, list[int]]]:
    """Each list the machines were given: (machine, cluster, the serials it revokes)."""
    return [(name, kwargs["cluster"], revoked_in(kwargs["krl"])) for name, called, kwargs in agents.calls
            if called == "node_revocations_write"]


def revoked_in(krl: bytes) -> list[int]:
    """The serials of a KRL as machines/ssh_krl.py writes them (one certificates section, one serial list)."""
    at = 8 + 4 + 8 + 8 + 8
    for _ in range(2):  # reserved, comment
        at += 4 + int.from_bytes(krl[at:at + 4], "big")
    if at == len(krl):
        return []
    body = krl[at + 5:]
    at = 4 + int.from_bytes(body[:4], "big")
    at += 4 + int.from_bytes(body[at:at + 4], "big")
    assert body[at] == ssh_krl.CERT_SERIAL_LIST
    size = int.from_bytes(body[at + 1:at + 5], "big")
    data = body[at + 5:at + 5 + size]
    return [int.from_bytes(data[i:i + 8], "big") for i in range(0, size, 8)]


# -- the list ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_SSH_KEYGEN, reason="ssh-keygen is not installed")
def test_ssh_keygen_reads_the_list_as_revoking_exactly_its_serials(tmp_path):
    ca = ssh_ca.ca_public_key()
    signed = {}
    for serial in (5, 6):
        key = tmp_path / f"id_{serial}"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        certificate = ssh_ca.certificate_for(key.with_suffix(".pub").read_text(), principals=["fadenstack-cluster-1"],
                                             key_id=f"fadenstack:ada:gpu-room:{serial}", valid_seconds=600, serial=serial)
        signed[serial] = tmp_path / f"id_{serial}-cert.pub"
        signed[serial].write_text(certificate + "\n")
    krl = tmp_path / "revoked.krl"
    krl.write_bytes(ssh_krl.krl_bytes(ca_public_key=ca, serials=[5, 9], version=3, generated_at=1_700_000_000))
    empty = tmp_path / "empty.krl"
    empty.write_bytes(ssh_krl.krl_bytes(ca_public_key=ca, version=1, generated_at=1_700_000_000))

    listed = subprocess.run(["ssh-keygen", "-Q", "-l", "-f", str(krl)], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    five = subprocess.run(["ssh-keygen", "-Q", "-f", str(krl), str(signed[5])], capture_output=True, text=True)
    six = subprocess.run(["ssh-keygen", "-Q", "-f", str(krl), str(signed[6])], capture_output=True, text=True)
    none = subprocess.run(["ssh-keygen", "-Q", "-f", str(empty), str(signed[5])], capture_output=True, text=True)

    assert five.returncode != 0 and "REVOKED" in five.stdout
    assert six.returncode == 0 and "ok" in six.stdout
    assert none.returncode == 0 and "ok" in none.stdout


def test_every_certificate_signed_for_a_cluster_is_recorded_with_it_and_listed(room):
    ada = UserFactory(username="ada")
    issued = sign(ada, room, node="node-1")

    row = NodeCertificate.objects.get()
    assert (row.cluster, row.certificate_id, row.certificate.username) == (room, issued.serial, "ada")
    assert node_logins.login_state(row) == "valid"
    card = node_logins.node_logins_card(room, roles.ADMINISTRATOR)["node_logins"]
    assert [(r["serial"], r["username"], r["nodes"], r["state"]) for r in card["rows"]] == [(issued.serial, "ada", "lab-b", "valid")]
    assert card["offer"].ok and not node_logins.node_logins_card(room, roles.OPERATOR)["node_logins"]["offer"].ok


# -- an Administrator takes one back ----------------------------------------------------------------------------


def test_an_administrator_takes_one_back_the_list_goes_to_every_member_and_the_audit_says_so(room, agents, on_commit):
    ada, admin = UserFactory(username="ada"), UserFactory(username="root-admin")
    kept, taken = sign(ada, room), sign(ada, room)

    with on_commit(execute=True):
        node_logins.node_login_revoke(cluster=room, serial=taken.serial, user=admin)

    row = NodeCertificate.objects.get(certificate_id=taken.serial)
    assert row.revoked_at is not None and row.revoked_by == admin and row.revoked_reason == "Taken back by root-admin."
    assert NodeCertificate.objects.get(certificate_id=kept.serial).revoked_at is None
    assert sorted(pushes(agents)) == [("lab-a", "gpu-room", [taken.serial]), ("lab-b", "gpu-room", [taken.serial])]
    entry = AuditEntry.objects.get(action="cluster.node_login_revoke")
    assert entry.username == "root-admin" and taken.key_id in entry.message and entry.target == "cluster gpu-room"
    assert node_logins.revoked_serials(room.pk) == [taken.serial]


def test_only_an_administrator_may_take_one_back(room, agents):
    issued = sign(UserFactory(username="ada"), room)
    operator = UserFactory(username="op", role=roles.OPERATOR)

    with pytest.raises(node_logins.PermissionDenied):
        node_logins.node_login_revoke(cluster=room, serial=issued.serial, user=operator)
    assert NodeCertificate.objects.get().revoked_at is None and pushes(agents) == []


def test_the_button_and_the_api_take_one_back(client, room, agents, on_commit):
    admin = UserFactory(username="root-admin")
    first, second = sign(admin, room), sign(admin, room)
    client.force_login(admin)

    page = client.post(f"/clusters/{room.pk}/node-logins/{first.serial}/revoke/")
    listed = client.get(f"/api/clusters/{room.pk}/node-logins/").json()
    api = client.post(f"/api/clusters/{room.pk}/node-logins/{second.serial}/revoke/")
    missing = client.post(f"/api/clusters/{room.pk}/node-logins/999999/revoke/")

    assert page.status_code == 302 and page["Location"].endswith("#cluster-node-logins")
    assert [(r["serial"], r["state"]) for r in listed["results"]] == [(second.serial, "valid"), (first.serial, "revoked")]
    assert api.status_code == 200 and api.json()["state"] == "revoked" and api.json()["revoked_by"] == "root-admin"
    assert missing.status_code == 404
    shown = client.get(f"/clusters/{room.pk}/").content.decode()
    assert 'id="cluster-node-logins"' in shown and "Taken back" in shown


def test_a_member_that_is_offline_is_not_asked_and_one_that_refuses_is_logged(room, agents, caplog, on_commit):
    Machine.objects.filter(name="lab-b").update(state=MachineState.OFFLINE)
    issued = sign(UserFactory(username="ada"), room)
    Machine.objects.filter(name="lab-b").update(state=MachineState.HEALTHY)
    agents.answers["lab-a"] = {"error": "Connection refused"}
    Machine.objects.filter(name="lab-b").update(state=MachineState.OFFLINE)

    with on_commit(execute=True):
        node_logins.node_login_revoke(cluster=room, serial=issued.serial, user=UserFactory(username="root-admin"))

    assert pushes(agents) == []
    assert "lab-a did not take gpu-room's revocation list: Connection refused" in caplog.text
    # lab-b comes back: it gets the list then.
    Machine.objects.filter(name="lab-b").update(state=MachineState.HEALTHY)
    node_logins.revocations_push_machine(Machine.objects.get(name="lab-b").pk)
    assert pushes(agents) == [("lab-b", "gpu-room", [issued.serial])]


def test_the_node_settings_carry_the_list(room):
    from clusters.node_files import node_files_specs

    issued = sign(UserFactory(username="ada"), room)
    node_logins.node_login_revoke(cluster=room, serial=issued.serial, user=UserFactory(username="root-admin"))

    specs = node_files_specs(room)

    for spec in specs.values():
        assert "RevokedKeys /etc/fadenstack/ssh/revoked.krl" in spec["sshd"]["dropin"]
        assert revoked_in(base64.b64decode(spec["sshd"]["revoked_keys"])) == [issued.serial]


# -- what takes them back by itself -----------------------------------------------------------------------------


def live_serials() -> list[int]:
    return sorted(NodeCertificate.objects.filter(revoked_at__isnull=True).values_list("certificate_id", flat=True))


def test_a_deactivated_user_loses_every_certificate_at_once(room, agents, on_commit):
    ada, bob = UserFactory(username="ada"), UserFactory(username="bob")
    mine, theirs = sign(ada, room), sign(bob, room)

    with on_commit(execute=True):
        ada.is_active = False
        ada.save()

    assert live_serials() == [theirs.serial]
    assert NodeCertificate.objects.get(certificate_id=mine.serial).revoked_reason == "ada may no longer log in to nodes."
    assert sorted(pushes(agents)) == [("lab-a", "gpu-room", [mine.serial]), ("lab-b", "gpu-room", [mine.serial])]


def test_a_demoted_administrator_loses_them_and_one_still_allowed_keeps_them(room, agents, on_commit):
    ada, bob = UserFactory(username="ada"), UserFactory(username="bob")
    mine, theirs = sign(ada, room), sign(bob, room)

    with on_commit(execute=True):
        roles.role_set(ada, roles.VIEWER)
    with on_commit(execute=True), transaction.atomic():  # one change, as the Users page makes it
        roles.role_set(bob, roles.OPERATOR)
        roles.node_logins_set(bob, True)  # an Operator allowed node logins may still have them

    assert live_serials() == [theirs.serial]


def test_an_operator_who_loses_the_node_login_permission_loses_them(room, agents, on_commit):
    op = UserFactory(username="op", role=roles.OPERATOR)
    roles.node_logins_set(op, True)
    issued = sign(op, room)

    with on_commit(execute=True):
        roles.node_logins_set(op, False)

    assert live_serials() == []
    assert pushes(agents) and all(serials == [issued.serial] for _, _, serials in pushes(agents))


def test_the_group_taken_from_its_side_and_a_deleted_account_take_them_back_too(room, agents, on_commit):
    op, ada = UserFactory(username="op", role=roles.OPERATOR), UserFactory(username="ada")
    roles.node_logins_set(op, True)
    sign(op, room)
    sign(ada, room)

    with on_commit(execute=True):
        Group.objects.get(name=roles.NODE_LOGIN.group).user_set.clear()
    assert len(live_serials()) == 1
    with on_commit(execute=True):
        ada.delete()
    assert live_serials() == []
    assert NodeCertificate.objects.filter(revoked_reason="ada's account was deleted.").count() == 1


def test_expired_certificates_leave_the_list_after_a_days_grace(room):
    from datetime import timedelta

    from django.utils import timezone

    issued = sign(UserFactory(username="ada"), room)
    node_logins.node_login_revoke(cluster=room, serial=issued.serial, user=UserFactory(username="root-admin"))
    row = NodeCertificate.objects.get()
    row.certificate.valid_before = timezone.now() - timedelta(hours=23)
    row.certificate.save()
    assert node_logins.revoked_serials(room.pk) == [issued.serial]
    row.certificate.valid_before = timezone.now() - timedelta(hours=25)
    row.certificate.save()
    assert node_logins.revoked_serials(room.pk) == []


def test_the_admin_lists_them_and_takes_the_selected_back(client, room, agents):
    admin = UserFactory(username="root-admin", is_superuser=True, is_staff=True)
    issued = sign(admin, room)
    client.force_login(admin)

    listed = client.get("/admin/clusters/nodecertificate/")
    taken = client.post("/admin/clusters/nodecertificate/", {"action": "take_back", "_selected_action": [
        NodeCertificate.objects.get().pk]})

    assert listed.status_code == 200 and issued.key_id in listed.content.decode()
    assert taken.status_code == 302 and NodeCertificate.objects.get().revoked_by == admin
