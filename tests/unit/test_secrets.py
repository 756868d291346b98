"""Sealed secrets: encrypted in the database under a key kept in a private file beside it, made on first use;
a value the key cannot open reads as not set, with a warning that names the secret and never its value."""
import logging
import stat

import pytest
from cryptography.fernet import Fernet

from console import secrets
from console.models import SealedSecret

pytestmark = pytest.mark.django_db

VALUE = "hf_SealedValue1234567890"


@pytest.fixture
def key_path(settings, tmp_path):
    settings.FADEN_SECRETS_KEY_PATH = tmp_path / "keys" / "secrets.key"
    return settings.FADEN_SECRETS_KEY_PATH


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_secret_set_reads_back_and_is_stored_sealed(key_path):
    secrets.secret_set("test.token", VALUE)

    assert secrets.secret_get("test.token") == VALUE
    assert secrets.secret_is_set("test.token")
    sealed = SealedSecret.objects.get(name="test.token").sealed
    assert VALUE not in sealed and VALUE.encode().hex() not in sealed
    assert Fernet(key_path.read_bytes().strip()).decrypt(sealed.encode()).endswith(VALUE.encode())


def test_the_key_is_made_on_first_use_readable_only_by_the_console_and_kept(key_path):
    assert not key_path.exists()

    secrets.secret_set("test.token", VALUE)
    key = key_path.read_bytes()
    secrets.secret_set("test.other", "another-value")

    assert (mode(key_path), mode(key_path.parent)) == (0o600, 0o700)
    assert key_path.read_bytes() == key
    assert list(key_path.parent.iterdir()) == [key_path]  # no temporary file left


def test_the_key_lives_in_the_data_directory_unless_the_setting_says_otherwise(settings, monkeypatch, tmp_path):
    settings.FADEN_SECRETS_KEY_PATH = None
    monkeypatch.delenv("FADEN_SECRETS_KEY_PATH", raising=False)
    assert secrets.secrets_key_path() == settings.DATA_DIR / "secrets.key"

    monkeypatch.setenv("FADEN_SECRETS_KEY_PATH", str(tmp_path / "elsewhere.key"))
    assert secrets.secrets_key_path() == tmp_path / "elsewhere.key"


def test_setting_again_replaces_the_value_and_clearing_forgets_it(key_path):
    secrets.secret_set("test.token", VALUE)
    secrets.secret_set("test.token", "hf_TheNewOne")

    assert secrets.secret_get("test.token") == "hf_TheNewOne"
    assert SealedSecret.objects.filter(name="test.token").count() == 1
    assert secrets.secret_clear("test.token") is True
    assert (secrets.secret_get("test.token"), secrets.secret_is_set("test.token")) == (None, False)
    assert secrets.secret_clear("test.token") is False


def test_a_value_sealed_under_another_key_reads_as_not_set_with_a_warning_without_the_value(key_path, caplog):
    secrets.secret_set("test.token", VALUE)
    key_path.write_bytes(Fernet.generate_key())

    with caplog.at_level(logging.WARNING, logger="console.secrets"):
        assert secrets.secret_get("test.token") is None
        assert not secrets.secret_is_set("test.token")

    assert "test.token" in caplog.text and "cannot be unsealed" in caplog.text
    assert VALUE not in caplog.text
    secrets.secret_set("test.token", VALUE)  # setting it again seals it under the key now there
    assert secrets.secret_get("test.token") == VALUE


def test_a_sealed_value_copied_under_another_name_does_not_unseal(key_path):
    secrets.secret_set("test.token", VALUE)
    SealedSecret.objects.create(name="test.copy", sealed=SealedSecret.objects.get(name="test.token").sealed)

    assert secrets.secret_get("test.copy") is None


def test_a_key_file_that_holds_no_key_refuses_to_seal_and_reads_as_not_set(key_path, caplog):
    secrets.secret_set("test.token", VALUE)
    key_path.write_text("not a key\n")

    with pytest.raises(secrets.SecretsKeyError, match="holds no secrets key"):
        secrets.secret_set("test.token", VALUE)
    with caplog.at_level(logging.WARNING, logger="console.secrets"):
        assert secrets.secret_get("test.token") is None
    assert str(key_path) in caplog.text and VALUE not in caplog.text
