"""The console's own SSH key: made on first use, kept private, fingerprinted as ssh-keygen does."""
import shutil
import stat
import subprocess

import paramiko
import pytest

from machines import remote


@pytest.fixture
def key_path(settings, tmp_path):
    settings.FADEN_SSH_KEY_PATH = tmp_path / "ssh" / "id_ed25519"
    return settings.FADEN_SSH_KEY_PATH


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_console_key_makes_an_ed25519_key_readable_only_by_the_console(key_path):
    key = remote.console_key()

    assert isinstance(key, paramiko.Ed25519Key)
    assert mode(key_path) == 0o600
    assert mode(key_path.parent) == 0o700


def test_console_key_is_made_once_and_kept(key_path):
    first = remote.console_key()
    second = remote.console_key()
    assert first.asbytes() == second.asbytes()
    assert sorted(p.name for p in key_path.parent.iterdir()) == ["id_ed25519", "id_ed25519.pub"]


def test_console_public_key_is_one_authorized_keys_line_for_the_private_key(key_path):
    line = remote.console_public_key()

    assert line.startswith("ssh-ed25519 ")
    assert "\n" not in line
    kind, blob, comment = line.split(" ")
    assert blob == remote.console_key().get_base64()
    assert comment.startswith("fadenstack-console@")


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="ssh-keygen is not installed")
def test_fingerprint_is_what_ssh_keygen_prints_for_the_public_key(key_path):
    key = remote.console_key()
    remote.console_public_key()

    printed = subprocess.run(
        ["ssh-keygen", "-lf", str(key_path.with_suffix(".pub"))], capture_output=True, text=True, check=True
    ).stdout.split()

    assert printed[0] == "256"
    assert remote.fingerprint(key) == printed[1]
    assert printed[1].startswith("SHA256:") and len(printed[1]) == len("SHA256:") + 43


def test_a_key_another_worker_made_first_is_the_one_kept_with_its_own_public_line(key_path, monkeypatch):
    """Two workers making the key at once: the one that links its key first wins, the other reads that
    key, and the public line on disk and the one handed out are the winner's (not the loser's)."""
    written = remote.write_once

    def other_worker_first(path, content):
        monkeypatch.setattr(remote, "write_once", written)
        remote.console_key()  # the other worker, all the way through, in between
        assert written(path, content) is False  # this one's key does not go in
        return False

    monkeypatch.setattr(remote, "write_once", other_worker_first)
    key = remote.console_key()

    blob = key_path.with_suffix(".pub").read_text().split()[1]
    assert blob == key.get_base64() == remote.console_public_key().split()[1]
    assert sorted(p.name for p in key_path.parent.iterdir()) == ["id_ed25519", "id_ed25519.pub"]
