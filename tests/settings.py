"""Settings for the test suite: the console's settings with a throwaway data directory and eager tasks."""
import os
import tempfile
import uuid

os.environ.setdefault("FADEN_DATA_DIR", tempfile.mkdtemp(prefix="fadenstack-test-"))
os.environ.setdefault("FADEN_CELERY_EAGER", "1")
# Live pushes of this run (and of the consoles it starts, which inherit the variable) stay apart from
# those of the other test worker and of any other console on the same Redis: a page of the browser
# tests must not receive the rows of the lab worker's machines.
os.environ.setdefault("FADEN_LIVE_PREFIX", f"fadenstack-test-{uuid.uuid4().hex[:8]}.live")
# The gateway's figures and failure reports likewise: a run's gateway and console read only their own.
os.environ.setdefault("FADEN_GATEWAY_REDIS_PREFIX", f"fadenstack-test-{uuid.uuid4().hex[:8]}.gateway")

# The suite's Django test clients post to /agent/ over plain HTTP, as agents before 0.10.0 did; the refusal
# without this setting is tested on its own (tests/unit/test_agent_tls.py). Real 0.10.0 agents in the lab get
# https:// and the pin all the same.
os.environ.setdefault("FADEN_AGENT_PLAIN_HTTP", "1")

from config.settings import *  # noqa: E402,F403

# No test reaches the real Hugging Face Hub: a download a test starts by accident is refused at once
# (port 9, discard, on loopback); the tests that download point this at a lab hub of their own.
FADEN_HF_ENDPOINT = os.environ.get("FADEN_TEST_HF_ENDPOINT", "http://127.0.0.1:9")

# The health checks' copies have made-up addresses (tests/builders.py) that no test may reach: their engines are
# not read (0 s) unless a test or a lab console asks (tests/unit/test_engine_metrics.py reads engines on loopback).
FADEN_ENGINE_METRICS_TIMEOUT = float(os.environ.get("FADEN_TEST_ENGINE_METRICS_TIMEOUT", "0"))

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins in tests
STORAGES = {"staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}

# A file, not memory, so that the browser tests' web server and worker processes share the test database.
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["default"]["TEST"] = {"NAME": os.path.join(os.environ["FADEN_DATA_DIR"], "test.sqlite3")}

if DATABASES["default"]["ENGINE"].endswith("postgresql"):
    # A throwaway database: a commit need not wait for the disk (the lab's console commits thousands).
    options = DATABASES["default"].setdefault("OPTIONS", {})
    options["options"] = f"{options.get('options', '')} -c synchronous_commit=off".strip()

    from tests import priority

    priority.connect_signal()  # each backend at the priority of the test process that opened it
