"""The Connect card on a cluster's page, its certificate page and the profile's keys, through the Django
test client: what each role sees, what the live push carries, and that a certificate is shown once."""
import html
import re

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.serialization import load_ssh_public_identity

from clusters import pages
from clusters.choices import ClusterState, MemberState
from console import roles
from console.models import AuditEntry
from machines import ssh_rules
from machines.models import SSHCertificate, UserPublicKey
from tests.builders import build, cluster_of, gpu_machine
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def ca_path(settings, tmp_path):
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "ssh" / "ca_ed25519"
    settings.FADEN_SSH_CERT_SECONDS = 3600
    settings.FADEN_MACHINES_REACHABLE = True
    settings.FADEN_SSH_JUMP = ""


@pytest.fixture
def room():
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12, accelerators=4)], runtime=build("2.1.0"))


def ed25519_line(comment: str = "ada@laptop") -> str:
    public = ed25519.Ed25519PrivateKey.generate().public_key()
    return public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode() + f" {comment}"


def client_as(client, role):
    client.force_login(UserFactory(username=f"user-{role.slug}", role=role))
    return client


def card(page_html: str) -> str:
    """The Connect card's HTML, unescaped as a browser's Copy reads it."""
    match = re.search(r'<section id="cluster-connect".*?</section>', page_html, re.S)
    assert match, "no Connect card on the page"
    return html.unescape(match.group(0))


def page(client, cluster) -> str:
    response = client.get(f"/clusters/{cluster.pk}/")
    assert response.status_code == 200
    return response.content.decode()


# -- the card --------------------------------------------------------------------------------------


def test_the_card_lists_every_node_with_its_rank_machine_address_gpus_and_ssh_command(admin_client, room):
    shown = card(page(admin_client, room))

    rows = re.findall(r'<tr id="connect-node-.*?</tr>', shown, re.S)
    assert len(rows) == 2
    for row, (name, machine, address, gpus, ssh) in zip(rows, [
            ("node-0", "lab-a", "198.18.1.11", "8 x H100 80GB", "ssh root@198.18.0.11"),
            ("node-1", "lab-b", "198.18.1.12", "4 x H100 80GB", "ssh root@198.18.0.12")]):
        for text in (name, machine, address, gpus, ssh):
            assert text in row, (text, row)
    assert "head" in rows[0] and "head" not in rows[1]
    assert "rank 1" in rows[1]


def test_the_card_gives_every_launcher_and_the_tunnel_with_the_clusters_addresses_each_with_a_copy_button(admin_client, room):
    shown = card(page(admin_client, room))

    for block, text in [
        ("torchrun", 'for node in node-0 node-1; do ssh "$node"'),
        ("mpirun", "mpirun --allow-run-as-root --hostfile /etc/fadenstack/hostfile -np 12"),
        ("deepspeed", "deepspeed --hostfile /etc/fadenstack/hostfile --master_addr 198.18.1.11 --master_port 29500"),
        ("ray_job_submit", "ray job submit --address http://127.0.0.1:8265"),
        ("ray_tunnel", "ssh -N -L 8265:127.0.0.1:8265 -L 10001:127.0.0.1:10001 root@198.18.0.11"),
    ]:
        assert re.search(rf'<pre class="copy__text" id="connect-{block}">[^<]*{re.escape(text)}', shown), block
        assert f'data-copy="#connect-{block}"' in shown
    assert 'data-copy="#connect-ssh-1"' in shown


def test_before_every_machine_is_up_the_card_says_which_it_waits_for_and_shows_no_command(admin_client, room):
    room.members.filter(machine__name="lab-b").update(state=MemberState.LOADING)

    shown = card(page(admin_client, room))

    assert "Waiting for lab-b to be Up: it is loading the image." in shown
    assert "ssh root@" not in shown and "data-copy" not in shown and "--master_addr" not in shown
    assert "Get an SSH certificate" not in shown


def test_a_stopped_cluster_card_says_so(admin_client):
    stopped = cluster_of([gpu_machine("lab-a", 11)], state=ClusterState.STOPPED)

    assert "gpu-room is stopped: the nodes and their commands appear once it runs" in card(page(admin_client, stopped))


def test_with_the_machines_not_reachable_the_card_jumps_through_the_console_host(admin_client, room, settings):
    settings.FADEN_MACHINES_REACHABLE = False
    settings.FADEN_SSH_JUMP = "console.example.com"

    shown = card(page(admin_client, room))

    assert "ssh -J console.example.com root@198.18.0.12" in shown
    assert "Through the console's host" in shown


@pytest.mark.parametrize("role, offered", [(roles.ADMINISTRATOR, True), (roles.OPERATOR, True), (roles.VIEWER, False)])
def test_every_role_sees_the_card_and_only_those_a_login_may_be_for_see_the_certificate_button(client, room, role, offered):
    shown = card(page(client_as(client, role), room))

    assert "ssh root@198.18.0.11" in shown
    assert ("Get an SSH certificate" in shown) is offered
    assert (f'href="/clusters/{room.pk}/ssh-certificate/"' in shown) is offered


@pytest.mark.parametrize("part", ["", "members"])
def test_the_live_push_carries_the_card_out_of_band_so_it_appears_when_the_last_machine_is_up(room, part):
    room.members.filter(machine__name="lab-b").update(state=MemberState.RAY)
    (waiting,) = pages.render_cluster_topic(str(room.pk), part, roles.VIEWER)
    room.members.update(state=MemberState.JOINED)
    (ready,) = pages.render_cluster_topic(str(room.pk), part, roles.VIEWER)

    assert re.search(r'id="cluster-connect"[^>]*hx-swap-oob="true"', waiting)
    assert "Waiting for lab-b to be Up" in waiting and "ssh root@" not in waiting
    assert "ssh root@198.18.0.12" in ready and "Get an SSH certificate" not in ready


# -- the certificate page --------------------------------------------------------------------------


def test_the_certificate_page_signs_a_pasted_key_for_one_node_and_shows_it_once(admin_client, room):
    key = ed25519_line()

    response = admin_client.post(f"/clusters/{room.pk}/ssh-certificate/", {"public_key": key, "node": "node-1"})

    assert response.status_code == 201 and response["Cache-Control"] == "no-store"
    shown = html.unescape(response.content.decode())
    line = re.search(r'<pre class="copy__text" id="ssh-certificate">([^<]+)</pre>', shown).group(1)
    signed = load_ssh_public_identity(line.encode())
    row = SSHCertificate.objects.get()
    assert signed.serial == row.pk and signed.valid_principals == [f"fadenstack-cluster-{room.pk}-machine-{room.members.get(machine__name='lab-b').machine_id}".encode()]
    assert "ssh root@198.18.0.12" in shown
    entry = AuditEntry.objects.get(method="POST")
    assert row.key_id in entry.message and line.split()[1] not in entry.message


def test_the_certificate_page_signs_a_key_of_ones_profile_by_name(admin_client, admin_user, room):
    kept = UserPublicKey(user=admin_user, name="laptop", key=ed25519_line())
    kept.full_clean()
    kept.save()

    form = admin_client.get(f"/clusters/{room.pk}/ssh-certificate/").content.decode()
    response = admin_client.post(f"/clusters/{room.pk}/ssh-certificate/", {"key": "laptop", "node": ""})

    assert '<option value="laptop" selected>' in form
    assert response.status_code == 201
    assert SSHCertificate.objects.get().principals == [f"fadenstack-cluster-{room.pk}"]


def test_a_bad_key_on_the_certificate_page_shows_the_rules_sentence_and_signs_nothing(admin_client, room):
    response = admin_client.post(f"/clusters/{room.pk}/ssh-certificate/", {"public_key": "-----BEGIN OPENSSH PRIVATE KEY-----"})

    assert response.status_code == 400
    assert html.escape(ssh_rules.PRIVATE_KEY) in response.content.decode()
    assert not SSHCertificate.objects.exists()


def test_a_viewer_reads_why_on_the_certificate_page_and_a_post_by_hand_is_a_403(client, room):
    viewer = client_as(client, roles.VIEWER)

    form = viewer.get(f"/clusters/{room.pk}/ssh-certificate/").content.decode()
    posted = viewer.post(f"/clusters/{room.pk}/ssh-certificate/", {"public_key": ed25519_line()})

    assert html.escape("Your role is Viewer: logging in to a node needs an Administrator") in form
    assert "<fieldset disabled>" in form
    assert posted.status_code == 403
    assert not SSHCertificate.objects.exists()


# -- the profile's keys ----------------------------------------------------------------------------


def test_the_profile_lists_adds_and_removes_ones_own_keys(client, room):
    operator = client_as(client, roles.OPERATOR)
    key = ed25519_line()

    added = operator.post("/profile/keys/add/", {"name": "laptop", "key": key}, follow=True)
    row = UserPublicKey.objects.get()
    listed = operator.get("/profile/keys/").content.decode()
    removed = operator.post(f"/profile/keys/{row.pk}/remove/", follow=True)

    assert f"Added the key laptop ({row.fingerprint})." in added.content.decode()
    assert f'id="profile-key-{row.pk}"' in listed and row.fingerprint in listed
    assert html.escape("Your role is Operator and node logins are not allowed for you yet") in listed
    assert "Removed the key laptop" in removed.content.decode()
    assert not UserPublicKey.objects.exists()


def test_the_profile_refuses_a_bad_key_with_the_rules_sentence_and_anothers_key_is_not_found(client, admin_client):
    other = UserFactory(username="vic", role=roles.VIEWER)
    theirs = UserPublicKey(user=other, name="laptop", key=ed25519_line())
    theirs.full_clean()
    theirs.save()

    bad = admin_client.post("/profile/keys/add/", {"name": "desk", "key": "ssh-ed25519 AAAA-cert-nonsense"})
    gone = admin_client.post(f"/profile/keys/{theirs.pk}/remove/")

    assert bad.status_code == 400 and html.escape(ssh_rules.NOT_OPENSSH) in bad.content.decode()
    assert gone.status_code == 404
    assert UserPublicKey.objects.get() == theirs
