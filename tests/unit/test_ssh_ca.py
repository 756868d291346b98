"""The console's SSH certificate authority: its key, the certificates it signs, who may ask (sshd's side: test_sshd_dropin.py)."""
import base64
import logging
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.serialization import SSHCertificate, SSHCertificateType, load_ssh_public_identity
from django.core.exceptions import PermissionDenied, ValidationError

from console import roles
from machines import ssh_ca, ssh_certificates, ssh_rules, sshd
from machines.models import SSHCertificate as CertificateRow
from machines.models import UserPublicKey
from tests.factories import NO_ROLE, UserFactory

HAS_SSH_KEYGEN = shutil.which("ssh-keygen") is not None
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


@pytest.fixture
def ca_path(settings, tmp_path):
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "data" / "ssh" / "ca_ed25519"
    settings.FADEN_SSH_CERT_SECONDS = 3600
    return settings.FADEN_SSH_CA_KEY_PATH


def public_line(private, comment: str = "alice@laptop") -> str:
    blob = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return f"{blob.decode()} {comment}"


def ed25519_line(comment: str = "alice@laptop") -> str:
    return public_line(ed25519.Ed25519PrivateKey.generate(), comment)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def sign(public_key: str, **overrides) -> SSHCertificate:
    arguments = {"principals": ["fadenstack-cluster-3"], "key_id": "fadenstack:alice:gpu-room:7",
                 "valid_seconds": 3600, "serial": 7} | overrides
    return load_ssh_public_identity(ssh_ca.certificate_for(public_key, **arguments).encode())


# -- the authority's key --------------------------------------------------------------------------


def test_the_authority_key_is_made_on_first_use_as_ed25519_readable_only_by_the_console(ca_path):
    line = ssh_ca.ca_public_key()

    assert mode(ca_path) == 0o600
    assert mode(ca_path.parent) == 0o700
    private = serialization.load_ssh_private_key(ca_path.read_bytes(), password=None)
    assert isinstance(private, ed25519.Ed25519PrivateKey)
    assert line == ca_path.with_suffix(".pub").read_text().strip()
    assert line.startswith("ssh-ed25519 ") and line.endswith(" fadenstack-ssh-ca")
    assert line.split()[1] == public_line(private).split()[1]  # the public file is the private key's


def test_the_authority_key_is_made_once_and_reused(ca_path):
    first = ssh_ca.ca_public_key()
    private_bytes = ca_path.read_bytes()
    ssh_ca.certificate_for(ed25519_line(), principals=["p"], key_id="k", valid_seconds=60, serial=1)

    assert ssh_ca.ca_public_key() == first
    assert ca_path.read_bytes() == private_bytes
    assert sorted(p.name for p in ca_path.parent.iterdir()) == [".ca_ed25519.lock", "ca_ed25519", "ca_ed25519.pub"]


# Each child sets Django up, says so, and waits for the word to ask for the authority's key: all at once.
CHILD = """
import sys, django
django.setup()
from machines import ssh_ca
print("ready", flush=True)
sys.stdin.readline()
print(ssh_ca.ca_public_key(), flush=True)
"""


def test_processes_starting_at_once_make_one_authority_and_agree_on_it(ca_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "FADEN_SSH_CA_KEY_PATH": str(ca_path)}
    children = [subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=env, cwd=settings_dir()) for _ in range(4)]
    for child in children:
        assert child.stdout.readline().strip() == "ready"
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    lines = [child.communicate(timeout=60)[0].strip() for child in children]

    private = serialization.load_ssh_private_key(ca_path.read_bytes(), password=None)
    assert [child.returncode for child in children] == [0] * len(children)
    assert set(lines) == {ca_path.with_suffix(".pub").read_text().strip()}
    assert lines[0].split()[1] == public_line(private).split()[1]


def test_a_lost_public_file_is_written_again_from_the_private_key(ca_path):
    line = ssh_ca.ca_public_key()
    ca_path.with_suffix(".pub").unlink()

    assert ssh_ca.ca_public_key() == line
    assert ca_path.with_suffix(".pub").exists()


def test_the_fingerprint_is_empty_before_the_authority_exists_unless_asked_to_make_it(ca_path):
    assert ssh_ca.ca_fingerprint(create=False) == ""
    assert not ca_path.exists()
    assert ssh_ca.ca_fingerprint().startswith("SHA256:")
    assert ca_path.exists()


def test_a_damaged_key_file_is_named_but_never_quoted(ca_path):
    ca_path.parent.mkdir(parents=True)
    ca_path.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nNOT-A-KEY-BUT-SECRET-LOOKING\n")
    (ca_path.with_suffix(".pub")).write_text(ed25519_line())

    with pytest.raises(ssh_ca.CertificateAuthorityError) as raised:
        ssh_ca.certificate_for(ed25519_line(), principals=["p"], key_id="k", valid_seconds=60, serial=1)

    assert str(ca_path) in str(raised.value)
    assert "NOT-A-KEY" not in str(raised.value)


def test_the_settings_make_the_authority_key_private_at_every_start_wherever_it_is(tmp_path):
    elsewhere = tmp_path / "keys" / "ca_ed25519"
    elsewhere.parent.mkdir()
    elsewhere.write_text("a key left readable by a restore\n")
    elsewhere.chmod(0o644)
    env = {**os.environ, "FADEN_DATA_DIR": str(tmp_path / "data"), "FADEN_SSH_CA_KEY_PATH": str(elsewhere)}

    subprocess.run([sys.executable, "-c", "import config.settings"], env=env, check=True, cwd=settings_dir())

    assert mode(elsewhere) == 0o600


def settings_dir() -> str:
    from django.conf import settings

    return str(settings.BASE_DIR)


# -- signing --------------------------------------------------------------------------------------


def test_a_certificate_reads_back_with_its_principals_key_id_serial_and_validity(ca_path):
    user_key = ed25519_line()
    before = int(time.time())
    certificate = sign(user_key, principals=["fadenstack-machine-1", "fadenstack-machine-2"], serial=41,
                       key_id="fadenstack:alice:gpu-room:41", valid_seconds=3600)
    after = int(time.time())

    assert certificate.type is SSHCertificateType.USER
    assert certificate.key_id == b"fadenstack:alice:gpu-room:41"
    assert certificate.serial == 41
    assert certificate.valid_principals == [b"fadenstack-machine-1", b"fadenstack-machine-2"]
    assert before - 60 <= certificate.valid_after <= after - 60  # a minute in the past, for clock skew
    assert before + 3600 <= certificate.valid_before <= after + 3600
    assert set(certificate.extensions) == {b"permit-port-forwarding", b"permit-pty"}
    assert certificate.critical_options == {}
    certificate.verify_cert_signature()
    signer = certificate.signature_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    assert signer.decode() == " ".join(ssh_ca.ca_public_key().split()[:2])
    subject = certificate.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    assert subject.decode() == " ".join(user_key.split()[:2])


@pytest.mark.skipif(not HAS_SSH_KEYGEN, reason="ssh-keygen is not installed")
def test_ssh_keygen_reads_the_key_id_principals_and_validity_of_a_certificate(ca_path, tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "id")], check=True)
    line = ssh_ca.certificate_for((tmp_path / "id.pub").read_text(), principals=["fadenstack-cluster-3"],
                                  key_id="fadenstack:alice:gpu-room:9", valid_seconds=1800, serial=9)
    (tmp_path / "id-cert.pub").write_text(line + "\n")

    shown = subprocess.run(["ssh-keygen", "-L", "-f", str(tmp_path / "id-cert.pub")],
                           capture_output=True, text=True, check=True, env={"TZ": "UTC", "PATH": os.environ["PATH"]}).stdout
    fields = {k.strip(): v.strip() for k, _, v in (row.partition(":") for row in shown.splitlines()[1:]) if v.strip()}

    assert "user certificate" in fields["Type"]
    assert fields["Key ID"] == '"fadenstack:alice:gpu-room:9"'
    assert fields["Serial"] == "9"
    assert shown.split("Principals:")[1].split()[0] == "fadenstack-cluster-3"
    assert ssh_ca.ca_fingerprint() in fields["Signing CA"]
    start, end = fields["Valid"].removeprefix("from ").split(" to ")
    span = time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S")) - time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S"))
    assert span == 1800 + 60


@pytest.mark.parametrize(("overrides", "words"), [
    ({"valid_seconds": 24 * 3600 + 1}, "a day"),
    ({"valid_seconds": 0}, "a day"),
    ({"principals": []}, "at least one principal"),
    ({"principals": ["root,admin"]}, "not one sshd reads safely"),
    ({"serial": 0}, "positive 64-bit"),
    ({"key_id": "two\nlines"}, "one line"),
])
def test_certificate_for_refuses_what_no_certificate_should_carry(ca_path, overrides, words):
    with pytest.raises(ValueError, match=words):
        sign(ed25519_line(), **overrides)


def test_certificate_for_refuses_a_key_the_rules_refuse(ca_path):
    short = public_line(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    with pytest.raises(ssh_rules.PublicKeyRefused):
        sign(short)


# -- the request rules: which key -----------------------------------------------------------------


def test_the_accepted_kinds_are_parsed_with_their_fingerprint(ca_path):
    keys = {
        "ssh-ed25519": ed25519.Ed25519PrivateKey.generate(),
        "ecdsa-sha2-nistp256": ec.generate_private_key(ec.SECP256R1()),
        "ecdsa-sha2-nistp384": ec.generate_private_key(ec.SECP384R1()),
        "ecdsa-sha2-nistp521": ec.generate_private_key(ec.SECP521R1()),
        "ssh-rsa": rsa.generate_private_key(public_exponent=65537, key_size=3072),
    }
    for kind, private in keys.items():
        parsed = ssh_rules.public_key_parse(public_line(private, "bob@desk  two words") + "\n")
        assert parsed.kind == kind
        assert parsed.comment == "bob@desk two words"
        assert parsed.line == public_line(private, "bob@desk two words")
        blob = base64.b64decode(parsed.blob)
        assert parsed.fingerprint == ssh_rules.fingerprint_of(blob)
    assert ssh_rules.public_key_parse(public_line(keys["ssh-rsa"])).bits == 3072


@pytest.mark.skipif(not HAS_SSH_KEYGEN, reason="ssh-keygen is not installed")
def test_the_fingerprint_is_what_ssh_keygen_prints(tmp_path):
    (tmp_path / "k.pub").write_text(ed25519_line() + "\n")
    printed = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "k.pub")], capture_output=True, text=True, check=True).stdout
    assert ssh_rules.public_key_parse((tmp_path / "k.pub").read_text()).fingerprint == printed.split()[1]


def _refusals(ca_line: str) -> list[tuple[str, str]]:
    ed = ed25519_line()
    rsa_2048 = public_line(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    private_pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()
    return [
        ("", "Paste a public key: one line such as ssh-ed25519 AAAA... you@laptop."),
        ("   \n ", "Paste a public key: one line such as ssh-ed25519 AAAA... you@laptop."),
        (private_pem, "This is a private key: paste the public one (the .pub file) and keep the private key to yourself."),
        ("---- BEGIN SSH2 PUBLIC KEY ----\nAAAAC3Nz\n---- END SSH2 PUBLIC KEY ----",
         "This public key is in the SSH2 format: convert it with ssh-keygen -i -f key.pub and paste the line that prints."),
        (f"{ed}\n{ed25519_line()}", "Paste one public key on one line: this text has 2 lines."),
        ("ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQ= alice",
         "This is an SSH certificate, not a public key: paste the public key it was made for "
         "(the .pub file without -cert in its name)."),
        ("ssh-dss AAAAB3NzaC1kc3MAAACBAP alice",
         "Keys of type ssh-dss are not accepted: use ssh-ed25519, ecdsa-sha2-nistp256/384/521, or ssh-rsa of at least 3072 bits."),
        ("sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5QG9wZW5zc2guY29t alice",
         "Keys of type sk-ssh-ed25519@openssh.com are not accepted: use ssh-ed25519, ecdsa-sha2-nistp256/384/521, "
         "or ssh-rsa of at least 3072 bits."),
        ("hello there", "This is not an OpenSSH public key: paste one line such as ssh-ed25519 AAAA... you@laptop."),
        ("ssh-ed25519", "This is not an OpenSSH public key: paste one line such as ssh-ed25519 AAAA... you@laptop."),
        ("ssh-ed25519 not*base64", "This is not an OpenSSH public key: paste one line such as ssh-ed25519 AAAA... you@laptop."),
        (ed.replace("ssh-ed25519", "ssh-rsa", 1),  # the type word and the key inside disagree
         "This is not an OpenSSH public key: paste one line such as ssh-ed25519 AAAA... you@laptop."),
        (f'from="10.0.0.1" {ed}', "This is not an OpenSSH public key: paste one line such as ssh-ed25519 AAAA... you@laptop."),
        (rsa_2048, "This ssh-rsa key has 2048 bits and RSA keys need at least 3072: make an ed25519 key with ssh-keygen -t ed25519."),
        (ca_line, "This is the console's own certificate authority key, which cannot sign for itself: paste your own public key."),
    ]


def test_each_refused_key_is_refused_with_its_one_sentence(ca_path):
    ca_fingerprint = ssh_ca.ca_fingerprint()
    for text, sentence in _refusals(ssh_ca.ca_public_key()):
        with pytest.raises(ssh_rules.PublicKeyRefused) as refused:
            ssh_rules.public_key_parse(text, ca_fingerprint=ca_fingerprint)
        assert refused.value.message == sentence, text
        assert sentence.replace("...", "").count(". ") == 0 and sentence.endswith("."), "one sentence"


# -- the request rules: who may ask -------------------------------------------------------------


def test_who_may_ask_for_a_certificate():
    offer = ssh_rules.node_login_offer
    assert offer(role=roles.ADMINISTRATOR, allowed=False).ok
    assert offer(role=roles.OPERATOR, allowed=True).ok
    operator = offer(role=roles.OPERATOR, allowed=False)
    assert not operator.ok and operator.forbidden
    assert operator.why == "Your role is Operator and node logins are not allowed for you yet: an Administrator can allow them."
    for allowed in (False, True):  # a Viewer never, whatever they were given
        viewer = offer(role=roles.VIEWER, allowed=allowed)
        assert not viewer.ok and viewer.forbidden
        assert viewer.why == ("Your role is Viewer: logging in to a node needs an Administrator, "
                              "or an Operator an Administrator allowed node logins.")
    assert offer(role=None, allowed=True).why.startswith("Your account has no role: logging in to a node needs")
    assert offer(role=roles.CONSOLE, allowed=True).why == "A certificate names the person who logs in: the console signs none for itself."


def test_the_person_is_asked_before_the_key(ca_path):
    refused = ssh_rules.certificate_request_offer(role=roles.VIEWER, node_logins_allowed=False, public_key="junk",
                                                  ca_fingerprint="")
    assert refused.forbidden and refused.why.startswith("Your role is Viewer")
    bad_key = ssh_rules.certificate_request_offer(role=roles.ADMINISTRATOR, node_logins_allowed=True, public_key="junk",
                                                  ca_fingerprint="")
    assert not bad_key.ok and not bad_key.forbidden and bad_key.why.startswith("This is not an OpenSSH public key")


@pytest.mark.django_db
def test_the_node_logins_group_holds_exactly_its_permission():
    from django.contrib.auth.models import Group

    group = Group.objects.get(name="Node logins")
    assert [p.codename for p in group.permissions.all()] == ["node_login"]
    assert Group.objects.get(name="Operator").permissions.filter(codename="node_login").count() == 0
    assert Group.objects.get(name="Administrator").permissions.filter(codename="node_login").count() == 1


@pytest.mark.django_db
def test_a_viewer_is_refused_a_certificate_even_in_the_node_logins_group(ca_path):
    viewer = UserFactory(username="vera", role=roles.VIEWER)
    roles.node_logins_set(viewer, True)

    with pytest.raises(PermissionDenied, match="^Your role is Viewer: logging in to a node needs"):
        ssh_certificates.certificate_issue(user=viewer, public_key=ed25519_line(), cluster="gpu-room", principals=["p"])
    assert not CertificateRow.objects.exists()


@pytest.mark.django_db
def test_an_account_without_a_role_is_refused(ca_path):
    nobody = UserFactory(username="nobody", role=NO_ROLE)
    with pytest.raises(PermissionDenied, match="^Your account has no role"):
        ssh_certificates.certificate_issue(user=nobody, public_key=ed25519_line(), cluster="gpu-room", principals=["p"])


@pytest.mark.django_db
def test_an_operator_is_refused_until_an_administrator_allows_node_logins_then_allowed_until_taken_back(ca_path):
    operator = UserFactory(username="otto", role=roles.OPERATOR)
    key = ed25519_line()

    def ask():
        return ssh_certificates.certificate_issue(user=operator, public_key=key, cluster="gpu-room", principals=["p"])

    with pytest.raises(PermissionDenied, match="^Your role is Operator and node logins are not allowed for you yet"):
        ask()
    roles.node_logins_set(operator, True)
    assert roles.node_logins_allowed(operator)
    assert ask().key_id.startswith("fadenstack:otto:gpu-room:")
    roles.node_logins_set(operator, False)
    with pytest.raises(PermissionDenied):
        ask()


@pytest.mark.django_db
def test_node_logins_given_to_the_user_directly_in_the_admin_count_too(ca_path):
    from django.contrib.auth.models import Permission

    operator = UserFactory(username="olga", role=roles.OPERATOR)
    operator.user_permissions.add(Permission.objects.get(codename="node_login", content_type__app_label="console"))

    issued = ssh_certificates.certificate_issue(user=operator, public_key=ed25519_line(), cluster="c", principals=["p"])
    assert issued.serial > 0


# -- issuing: serial, key id, validity, record, logs ----------------------------------------------


@pytest.mark.django_db
def test_issued_certificates_name_the_person_and_cluster_and_take_increasing_serials(ca_path, settings):
    settings.FADEN_SSH_CERT_SECONDS = 900
    admin = UserFactory(username="alice")
    key = ed25519_line()

    first = ssh_certificates.certificate_issue(user=admin, public_key=key, cluster="gpu-room", principals=["fadenstack-cluster-3"])
    second = ssh_certificates.certificate_issue(user=admin, public_key=key, cluster="gpu-room", principals=["fadenstack-cluster-3"])

    assert second.serial > first.serial > 0
    for issued in (first, second):
        certificate = load_ssh_public_identity(issued.certificate.encode())
        assert certificate.serial == issued.serial
        assert certificate.key_id.decode() == issued.key_id == f"fadenstack:alice:gpu-room:{issued.serial}"
        assert certificate.valid_before - certificate.valid_after == 900 + 60
        row = CertificateRow.objects.get(pk=issued.serial)
        assert (row.username, row.key_id, row.principals) == ("alice", issued.key_id, ["fadenstack-cluster-3"])
        assert row.valid_before == issued.valid_before
        assert row.public_key_fingerprint == ssh_rules.public_key_parse(key).fingerprint


@pytest.mark.django_db
def test_a_shorter_validity_may_be_asked_but_never_a_longer_one(ca_path, settings):
    settings.FADEN_SSH_CERT_SECONDS = 600
    admin = UserFactory(username="alice")
    short = ssh_certificates.certificate_issue(user=admin, public_key=ed25519_line(), cluster="c", principals=["p"], valid_seconds=120)
    long = ssh_certificates.certificate_issue(user=admin, public_key=ed25519_line(), cluster="c", principals=["p"], valid_seconds=7200)
    assert (short.valid_before - short.valid_after).total_seconds() == 120 + 60
    assert (long.valid_before - long.valid_after).total_seconds() == 600 + 60


@pytest.mark.django_db
def test_the_authority_private_key_is_in_no_log_record_nor_in_the_certificate(ca_path, caplog):
    caplog.set_level(logging.DEBUG)
    admin = UserFactory(username="alice")

    issued = ssh_certificates.certificate_issue(user=admin, public_key=ed25519_line(), cluster="gpu-room", principals=["p"])

    private = serialization.load_ssh_private_key(ca_path.read_bytes(), password=None)
    seed = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    pem_body = "".join(ca_path.read_text().splitlines()[1:-1])
    secrets = [pem_body, pem_body[40:100], base64.b64encode(seed).decode(), seed.hex(), repr(seed)]
    messages = [record.getMessage() + repr(record.args) + repr(record.__dict__) for record in caplog.records]
    assert any("Made the console's SSH certificate authority" in m for m in messages)  # its first use was logged
    assert any(issued.key_id in m for m in messages)  # and the signing
    for text in [*messages, issued.certificate]:
        assert not any(secret in text for secret in secrets)
    certificate_bytes = base64.b64decode(issued.certificate.split()[1])
    assert seed not in certificate_bytes


@pytest.mark.django_db
def test_refused_principals_write_no_row(ca_path):
    admin = UserFactory(username="alice")
    with pytest.raises(ValidationError, match="at least one principal"):
        ssh_certificates.certificate_issue(user=admin, public_key=ed25519_line(), cluster="c", principals=[])
    assert not CertificateRow.objects.exists()


# -- users' own public keys -----------------------------------------------------------------------


@pytest.mark.django_db
def test_a_users_public_key_is_stored_as_one_line_with_its_fingerprint(ca_path):
    alice = UserFactory(username="alice")
    line = ed25519_line("alice@laptop")
    key = UserPublicKey(user=alice, name=" laptop ", key=f"  {line}\n")
    key.full_clean()
    key.save()

    assert (key.name, key.key) == ("laptop", line)
    assert key.fingerprint == ssh_rules.public_key_parse(line).fingerprint


@pytest.mark.django_db
def test_a_users_public_key_is_refused_with_the_rules_sentence(ca_path):
    alice = UserFactory(username="alice")
    short = public_line(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    with pytest.raises(ValidationError) as refused:
        UserPublicKey(user=alice, name="old", key=short).full_clean()
    assert refused.value.message_dict == {
        "key": ["This ssh-rsa key has 2048 bits and RSA keys need at least 3072: make an ed25519 key with ssh-keygen -t ed25519."]}
    with pytest.raises(ValidationError) as refused:
        UserPublicKey(user=alice, name="ca", key=ssh_ca.ca_public_key()).full_clean()
    assert "certificate authority" in refused.value.message_dict["key"][0]


@pytest.mark.django_db
def test_the_same_key_or_name_twice_is_refused_for_one_user_but_not_across_users(ca_path):
    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    line = ed25519_line()
    first = UserPublicKey(user=alice, name="laptop", key=line)
    first.full_clean()
    first.save()

    with pytest.raises(ValidationError, match="You have added this key already, under another name."):
        UserPublicKey(user=alice, name="desk", key=line).full_clean()
    with pytest.raises(ValidationError, match="You have a key of this name already"):
        UserPublicKey(user=alice, name="laptop", key=ed25519_line()).full_clean()
    UserPublicKey(user=bob, name="laptop", key=line).full_clean()
