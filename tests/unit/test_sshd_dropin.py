"""sshd's side of the console's SSH certificate authority: the drop-in and the principals, checked by sshd itself."""
import os
import shutil
import subprocess

import pytest

from machines import ssh_ca, sshd

HAS_SSH_KEYGEN = shutil.which("ssh-keygen") is not None
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


@pytest.fixture
def ca_path(settings, tmp_path):
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "data" / "ssh" / "ca_ed25519"
    return settings.FADEN_SSH_CA_KEY_PATH


def test_the_dropin_trusts_the_authority_and_reads_one_principals_file_per_account():
    text = sshd.sshd_dropin("/etc/fadenstack/ssh/principals/%u", "/etc/fadenstack/ssh/ca.pub")
    settings_lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert settings_lines == ["TrustedUserCAKeys /etc/fadenstack/ssh/ca.pub",
                              "AuthorizedPrincipalsFile /etc/fadenstack/ssh/principals/%u",
                              "RevokedKeys /etc/fadenstack/ssh/revoked.krl"]
    assert sshd.DROPIN_PATH == "/etc/ssh/sshd_config.d/fadenstack-ca.conf"


@pytest.mark.parametrize(("principals_file", "ca_key", "words"), [
    ("/etc/fadenstack/ssh/principals", "/etc/fadenstack/ssh/ca.pub", "for every account"),
    ("relative/%u", "/etc/fadenstack/ssh/ca.pub", "absolute path"),
    ("/etc/fadenstack/%u", "/etc/with space/ca.pub", "absolute path"),
    ("/etc/fadenstack/%u", "/etc/../ca.pub\nPermitRootLogin yes", "absolute path"),
])
def test_the_dropin_refuses_paths_sshd_would_misread(principals_file, ca_key, words):
    with pytest.raises(ValueError, match=words):
        sshd.sshd_dropin(principals_file, ca_key)


def test_a_machine_accepts_for_root_its_clusters_principal_and_its_own_within_that_cluster_only():
    assert sshd.root_principals(machine_id=12, cluster_id=3) == ["fadenstack-cluster-3", "fadenstack-cluster-3-machine-12"]
    assert sshd.principals_file_text(sshd.root_principals(machine_id=12, cluster_id=3)) == \
        "fadenstack-cluster-3\nfadenstack-cluster-3-machine-12\n"
    assert sshd.principals_file_for("root") == "/etc/fadenstack/ssh/principals/root"
    assert sshd.login_principals(cluster_id=3) == ["fadenstack-cluster-3"]
    assert sshd.login_principals(cluster_id=3, machine_ids=[12]) == ["fadenstack-cluster-3-machine-12"]
    # A certificate for one cluster names nothing another cluster's machines accept, nor machine 12 once in cluster 4.
    assert not set(sshd.login_principals(cluster_id=3, machine_ids=[12])) & set(sshd.root_principals(machine_id=12, cluster_id=4))
    assert not set(sshd.login_principals(cluster_id=3)) & set(sshd.root_principals(machine_id=12, cluster_id=31))
    with pytest.raises(ValueError):
        sshd.principals_file_text(["two words"])


def _sshd(*args: str) -> subprocess.CompletedProcess:
    """sshd with its arguments; it insists on its privilege separation directory, which a host without a
    running sshd lacks: then in a mount namespace of its own with a private /run (as the lab's machines)."""
    if os.path.isdir("/run/sshd"):
        return subprocess.run([SSHD, *args], capture_output=True, text=True)
    script = 'mount -t tmpfs tmpfs /run && mkdir /run/sshd && exec "$0" "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, SSHD, *args],
                          capture_output=True, text=True)


@pytest.fixture
def sshd_config(ca_path, tmp_path):
    if SSHD is None or not HAS_SSH_KEYGEN:
        pytest.skip("sshd is not installed (openssh-server)")
    if not os.path.isdir("/run/sshd") and (os.geteuid() != 0 or shutil.which("unshare") is None):
        pytest.skip("sshd needs /run/sshd, and only root with unshare can give it one here")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "host_key")], check=True)
    ca_public = tmp_path / "ca.pub"
    ca_public.write_text(ssh_ca.ca_public_key() + "\n")
    principals = tmp_path / "principals" / "root"
    principals.parent.mkdir()
    principals.write_text(sshd.principals_file_text(sshd.root_principals(machine_id=12, cluster_id=3)))
    (tmp_path / "sshd_config.d").mkdir()
    (tmp_path / "sshd_config.d" / "fadenstack-ca.conf").write_text(
        sshd.sshd_dropin(f"{tmp_path}/principals/%u", str(ca_public)))
    config = tmp_path / "sshd_config"
    config.write_text(f"Include {tmp_path}/sshd_config.d/*.conf\nHostKey {tmp_path}/host_key\n"
                      "PermitRootLogin prohibit-password\nAuthorizedPrincipalsFile none\n")
    return config


def test_sshd_accepts_a_config_that_includes_the_dropin(sshd_config, tmp_path):
    checked = _sshd("-t", "-f", str(sshd_config))
    assert checked.returncode == 0, checked.stderr

    effective = _sshd("-T", "-f", str(sshd_config), "-C", "user=root,host=laptop,addr=198.18.0.9")
    assert effective.returncode == 0, effective.stderr
    lines = effective.stdout.splitlines()
    assert f"trustedusercakeys {tmp_path}/ca.pub" in lines
    # The drop-in's value wins over the main file's later one: sshd keeps the first it reads.
    assert f"authorizedprincipalsfile {tmp_path}/principals/%u" in lines


def test_sshd_refuses_a_dropin_that_names_no_file(sshd_config, tmp_path):
    (tmp_path / "sshd_config.d" / "fadenstack-ca.conf").write_text("TrustedUserCAKeys\n")
    checked = _sshd("-t", "-f", str(sshd_config))
    assert checked.returncode != 0
    assert "TrustedUserCAKeys" in checked.stderr
