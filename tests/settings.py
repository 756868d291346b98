"""Settings for the test suite: the console's settings with a throwaway data directory and eager tasks."""
import os
import tempfile

os.environ.setdefault("FADEN_DATA_DIR", tempfile.mkdtemp(prefix="fadenstack-test-"))
os.environ.setdefault("FADEN_CELERY_EAGER", "1")

from config.settings import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins in tests
STORAGES = {"staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}

# A file, not memory, so that the browser tests' web server and worker processes share the test database.
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["default"]["TEST"] = {"NAME": os.path.join(os.environ["FADEN_DATA_DIR"], "test.sqlite3")}
