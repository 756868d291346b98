"""The data directory and the secrets in it are private to the console's user at every start."""
import os
import stat
import subprocess
import sys
from pathlib import Path

from config import data_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def an_old_data_dir(root: Path) -> Path:
    """A data directory as an older version, a hand or a restore left it: readable by everyone."""
    data = root / "data"
    (data / "ssh").mkdir(parents=True)
    (data / "runtime-images").mkdir()
    for name in ("secret_key", "db.sqlite3", "db.sqlite3-wal", "ssh/id_ed25519", "ssh/id_ed25519.pub", "runtime-images/x.img"):
        (data / name).write_text("something")
        (data / name).chmod(0o644)
    for directory in (data, data / "ssh", data / "runtime-images"):
        directory.chmod(0o755)
    return data


def test_an_existing_data_directory_and_every_file_in_it_lose_the_group_s_and_others_permissions(tmp_path):
    data = an_old_data_dir(tmp_path)

    data_dir.private(data)

    assert {mode(d) for d in (data, data / "ssh", data / "runtime-images")} == {0o700}
    assert {mode(f) for f in data.rglob("*") if f.is_file()} == {0o600}


def test_secrets_kept_elsewhere_are_tightened_and_links_are_left_alone(tmp_path):
    data = an_old_data_dir(tmp_path)
    key, target = tmp_path / "elsewhere" / "id_ed25519", tmp_path / "shared.txt"
    key.parent.mkdir()
    key.write_text("key")
    key.chmod(0o644)
    target.write_text("not ours")
    target.chmod(0o644)
    (data / "link").symlink_to(target)

    data_dir.private(data, secrets_elsewhere=[key, tmp_path / "missing"])

    assert mode(key) == 0o600
    assert mode(target) == 0o644


def test_a_sqlite_database_elsewhere_is_made_private_and_a_new_one_is_created_0600(tmp_path):
    data, old, new = tmp_path / "data", tmp_path / "old.sqlite3", tmp_path / "new.sqlite3"
    old.write_text("")
    old.chmod(0o644)

    data_dir.private(data, database={"ENGINE": "django.db.backends.sqlite3", "NAME": str(old)})
    data_dir.private(data, database={"ENGINE": "django.db.backends.sqlite3", "NAME": str(new)})
    data_dir.private(data, database={"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"})

    assert mode(old) == 0o600
    assert mode(new) == 0o600
    assert not Path(":memory:").exists()


def test_starting_the_console_tightens_a_data_directory_that_existed_before(tmp_path):
    data = an_old_data_dir(tmp_path)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "FADEN_DATA_DIR": str(data)}
    env.pop("DATABASE_URL", None)

    subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env, check=True, timeout=60)

    assert mode(data) == 0o700
    assert {mode(f) for f in data.rglob("*") if f.is_file()} == {0o600}
    assert mode(data / "db.sqlite3") == 0o600
