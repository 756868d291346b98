"""Settings for the Fadenstack console, read from the environment.

Every setting is listed in the README with its default. The defaults give a
one-host console: SQLite in the data directory and Redis on localhost.
"""
import os
import re
import secrets
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP

from config import data_dir

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool = False) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# Where the console keeps what is not in the database: its SSH key, the secret
# key, the SQLite file, agent builds. Outside the repository on purpose; made private
# to this user below, once every file in it is named.
DATA_DIR = Path(os.environ.get("FADEN_DATA_DIR", Path.home() / ".local/share/fadenstack"))
DATA_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)


def _secret_key() -> str:
    if key := os.environ.get("FADEN_SECRET_KEY"):
        return key
    path = DATA_DIR / "secret_key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(50))
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env_bool("FADEN_DEBUG")
# Machines post their heartbeat to the console at whatever address they see it
# on, so the host list is open by default; put the console's names here in production.
ALLOWED_HOSTS = os.environ.get("FADEN_ALLOWED_HOSTS", "*").split(",")
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("FADEN_CSRF_TRUSTED_ORIGINS", "").split(",") if o]

# Behind TLS, FADEN_SECURE=true: browsers and the API are sent to https and told to stay there (HSTS), and
# the session and CSRF cookies travel over https only. The machines' agents (/agent/: heartbeats, the first
# copies of images and model files) reach the console over TLS of their own (FADEN_AGENT_TLS_PORT, a
# certificate each agent pins: console/agent_tls.py); older agents over plain HTTP only with
# FADEN_AGENT_PLAIN_HTTP=true, which alone keeps /agent/ out of the redirect.
FADEN_SECURE = env_bool("FADEN_SECURE")
FADEN_AGENT_PLAIN_HTTP = env_bool("FADEN_AGENT_PLAIN_HTTP")
SECURE_SSL_REDIRECT = FADEN_SECURE
SECURE_REDIRECT_EXEMPT = [r"^agent/"] if FADEN_AGENT_PLAIN_HTTP else []
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = FADEN_SECURE
SECURE_HSTS_SECONDS = env_int("FADEN_HSTS_SECONDS", 365 * 24 * 3600) if FADEN_SECURE else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("FADEN_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("FADEN_HSTS_PRELOAD")  # the operator's choice: hard to undo (README)
# A proxy in front terminates TLS and says so, and where the request came from (X-Forwarded-For, read by
# console.audit.client_address). Trusted only when set: a client could forge these headers.
FADEN_BEHIND_PROXY = env_bool("FADEN_BEHIND_PROXY")
if FADEN_BEHIND_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    USE_X_FORWARDED_HOST = True

# Scripts, styles, fonts and connections from the console itself only: no inline script or style
# (progress bars get their width from static/js/console.js). Images may also be data: URLs (Swagger
# UI's icons). DRF's browsable API widens style-src for its own pages (console/api.py).
# docs/security.md says why each source is there.
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF, "data:"],
    "connect-src": [CSP.SELF],  # the live websocket is same-origin: 'self' covers ws: and wss:
    "object-src": [CSP.NONE],
    "base-uri": [CSP.SELF],
    "form-action": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
}

INSTALLED_APPS = [
    "daphne",
    "console.admin_site.ConsoleAdminConfig",  # django.contrib.admin, for Administrators only
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "django_htmx",
    "channels",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI and Redoc as static files: the API's pages need no internet
    "axes",  # failed sign-ins counted per address and per user name (console/logins.py)
    "console",
    "machines",
    "clusters",
    "deployments",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "console.audit.AuditMiddleware",  # outside CSRF and the sign-in check, so their refusals are recorded too
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "console.middleware.LoginRequiredForPages",
    "console.middleware.RoleRequiredForPages",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "axes.middleware.AxesMiddleware",  # last: it turns a refused sign-in into the lockout page
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "builtins": ["console.templatetags.units"],
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.roles.context",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{DATA_DIR / 'db.sqlite3'}"),
        conn_max_age=env_int("FADEN_DB_CONN_MAX_AGE", 0),
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Web, worker and beat share one SQLite file: wait for locks instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [  # FADEN_ADMIN_PASSWORD goes through them too
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses a locked-out address or user before any password check
    "django.contrib.auth.backends.ModelBackend",
]
# Sign-ins: after FADEN_LOGIN_FAILURE_LIMIT failures in a row from one address, or for one user name,
# sign-ins from there or for that name are refused for FADEN_LOGIN_LOCKOUT_MINUTES (each refused try
# starts the wait again). Every failure is logged and audited (console/logins.py).
AXES_FAILURE_LIMIT = env_int("FADEN_LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("FADEN_LOGIN_LOCKOUT_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]  # either one
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "console.logins.lockout_response"
AXES_CLIENT_IP_CALLABLE = "console.audit.client_address"
AXES_DISABLE_ACCESS_LOG = True  # successful sign-ins are in the audit trail
AXES_VERBOSE = False  # console/logins.py logs each failure in its own words
MESSAGE_STORAGE = "console.audit.AuditedMessageStorage"  # a page's message is its audit entry's words too
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = os.environ.get("FADEN_TIME_ZONE", "UTC")
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(os.environ.get("FADEN_STATIC_ROOT", BASE_DIR / "staticfiles"))

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
FADEN_CELERY_QUEUE = os.environ.get("FADEN_CELERY_QUEUE", "fadenstack")
# Live cards travel over Redis pub/sub, whose channels ignore the database number in REDIS_URL:
# consoles sharing one Redis server keep apart by this prefix, one per queue unless set.
FADEN_LIVE_PREFIX = os.environ.get("FADEN_LIVE_PREFIX") or f"{FADEN_CELERY_QUEUE}.live"

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
        # console/pubsub.py publishes with the same prefix, read from here.
        "CONFIG": {"hosts": [REDIS_URL], "prefix": FADEN_LIVE_PREFIX},
    }
}

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = env_bool("FADEN_CELERY_EAGER")
CELERY_TASK_DEFAULT_QUEUE = FADEN_CELERY_QUEUE
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE = {
    "machines-mark-offline": {
        "task": "machines.tasks.machines_mark_offline",
        "schedule": timedelta(seconds=env_int("FADEN_OFFLINE_TICK", 10)),
    },
    "clusters-retry-due": {
        "task": "clusters.tasks.clusters_retry_due",
        "schedule": timedelta(seconds=env_int("FADEN_RETRY_TICK", 15)),
    },
    "clusters-check": {
        "task": "clusters.tasks.clusters_check",
        "schedule": timedelta(seconds=env_int("FADEN_HEALTH_INTERVAL", 60)),
    },
    "jobs-reap": {
        "task": "console.tasks.jobs_reap",
        "schedule": timedelta(seconds=env_int("FADEN_JOB_REAP_TICK", 15)),
    },
    # Copies the gateway could not reach are looked at at once (deployments/copy_health.py), not at the next check.
    "deployments-gateway-failures": {
        "task": "deployments.tasks.gateway_failures",
        "schedule": timedelta(seconds=env_int("FADEN_GATEWAY_FAILURES_TICK", 2)),
    },
    # The keys' usage the gateways count in Redis, written to the database by the hour (deployments/gateway_usage.py).
    "deployments-gateway-usage": {
        "task": "deployments.tasks.gateway_usage_copy",
        "schedule": timedelta(seconds=env_int("FADEN_GATEWAY_USAGE_TICK", 15)),
    },
}

# Old records are pruned by age every hour (console.pruning); 0 keeps them for ever.
FADEN_KEEP_EVENTS_DAYS = env_int("FADEN_KEEP_EVENTS_DAYS", 90)  # machine events
FADEN_KEEP_JOBS_DAYS = env_int("FADEN_KEEP_JOBS_DAYS", 90)  # finished jobs; queued and running ones stay
FADEN_KEEP_CHECKS_DAYS = env_int("FADEN_KEEP_CHECKS_DAYS", 7)  # clusters' health checks: about 1,440 a day each
FADEN_KEEP_AUDIT_DAYS = env_int("FADEN_KEEP_AUDIT_DAYS", 365)  # the audit trail: who did what
FADEN_KEEP_CERTIFICATES_DAYS = env_int("FADEN_KEEP_CERTIFICATES_DAYS", 90)  # records of SSH certificates signed
FADEN_KEEP_KEY_USAGE_DAYS = env_int("FADEN_KEEP_KEY_USAGE_DAYS", 30)  # the gateway keys' usage by the hour
CELERY_BEAT_SCHEDULE["prune-old-records"] = {"task": "console.tasks.prune_old_records", "schedule": timedelta(hours=1)}

# Jobs: a running job's worker beats its row; a job silent for FADEN_JOB_STALE seconds lost it.
FADEN_JOB_BEAT = env_int("FADEN_JOB_BEAT", 5)
FADEN_JOB_STALE = env_int("FADEN_JOB_STALE", 45)

# Health checks and repairs of running clusters.
FADEN_HEALTH_INTERVAL = env_int("FADEN_HEALTH_INTERVAL", 60)  # every running cluster is looked at this often
FADEN_HEALTH_LOOK_AGAIN = env_int("FADEN_HEALTH_LOOK_AGAIN", 20)  # a problem is looked at again before any repair
FADEN_COPY_SILENT_GRACE = env_int("FADEN_COPY_SILENT_GRACE", 60)  # a running engine that does not answer, this long: restarted
FADEN_RESTART_ATTEMPTS = env_int("FADEN_RESTART_ATTEMPTS", 3)  # restarts of a cluster whose head stopped, then Failed
FADEN_RESTART_PAUSE = env_int("FADEN_RESTART_PAUSE", 30)  # before the second restart; doubles for the next
FADEN_FAILED_RETRY = env_int("FADEN_FAILED_RETRY", 900)  # a Failed cluster is tried again this often
FADEN_HEALTH_PARALLEL = env_int("FADEN_HEALTH_PARALLEL", 16)  # SSH sessions one check holds at once
# Seconds a check spends at most reading the engines' /metrics of one machine (the deployments' charts).
FADEN_ENGINE_METRICS_TIMEOUT = float(os.environ.get("FADEN_ENGINE_METRICS_TIMEOUT", "2"))
FADEN_PROBE_SECONDS = env_int("FADEN_PROBE_SECONDS", 3)  # the network test sends this long on each network
# The NCCL test (issue 13): 1 MiB up to this size, doubling; stopped after this many seconds; each size
# run warmup + iters times (nccl-tests' -w and -n). The suite sets a short sweep and a short limit.
FADEN_NCCL_TEST_MAX_BYTES = env_int("FADEN_NCCL_TEST_MAX_BYTES", 1024 ** 3)
FADEN_NCCL_TEST_LIMIT_SECONDS = env_int("FADEN_NCCL_TEST_LIMIT_SECONDS", 600)
FADEN_NCCL_TEST_ITERS = env_int("FADEN_NCCL_TEST_ITERS", 20)
FADEN_NCCL_TEST_WARMUP = env_int("FADEN_NCCL_TEST_WARMUP", 5)
if FADEN_NCCL_TEST_MAX_BYTES < 1024 ** 2 or FADEN_NCCL_TEST_ITERS < 1 or FADEN_NCCL_TEST_WARMUP < 0 or FADEN_NCCL_TEST_LIMIT_SECONDS < 1:
    raise ImproperlyConfigured("The NCCL test needs FADEN_NCCL_TEST_MAX_BYTES of at least 1 MiB (1048576), "
                               "FADEN_NCCL_TEST_ITERS of at least 1, FADEN_NCCL_TEST_WARMUP of 0 or more and "
                               "FADEN_NCCL_TEST_LIMIT_SECONDS of at least 1.")
# The NCCL test's first size (1 MiB); the suite starts its slow-link test lower, so its first five sizes cost less.
FADEN_NCCL_TEST_MIN_BYTES = env_int("FADEN_NCCL_TEST_MIN_BYTES", 1024 ** 2)
if not 1024 <= FADEN_NCCL_TEST_MIN_BYTES <= FADEN_NCCL_TEST_MAX_BYTES:
    raise ImproperlyConfigured("The NCCL test needs FADEN_NCCL_TEST_MIN_BYTES of at least 1 KiB (1024) and at most "
                               "FADEN_NCCL_TEST_MAX_BYTES.")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["console.permissions.HasRole"],
    # JSON bodies only, read within bounds (size, depth); ?page= parsed strictly (console/api.py).
    "DEFAULT_PARSER_CLASSES": ["console.api.JSONParser"],
    "DEFAULT_PAGINATION_CLASS": "console.api.PageNumberPagination",
    "PAGE_SIZE": 50,
    # Every operation's schema lists the errors it answers too (console/schema.py).
    "DEFAULT_SCHEMA_CLASS": "console.schema.ConsoleAutoSchema",
    "EXCEPTION_HANDLER": "console.api.exception_handler",
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer", "console.api.BrowsableAPIRenderer"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Fadenstack console API",
    "DESCRIPTION": "Machines, clusters and deployments on your own GPU machines.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Served by WhiteNoise from drf_spectacular_sidecar's static files, not from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # A cluster and its members both have a "state": each set of states keeps its own name however
    # many serializers show it (the list's and the detail's).
    "ENUM_NAME_OVERRIDES": {
        "ClusterStateEnum": "clusters.choices.ClusterState",
        "MemberStateEnum": "clusters.choices.MemberState",
        "ModelStateEnum": "deployments.choices.ModelState",
        "ModelSourceEnum": "clusters.choices.ModelSource",
    },
}

# SSH to the machines.
FADEN_SSH_KEY_PATH = Path(os.environ.get("FADEN_SSH_KEY", DATA_DIR / "ssh" / "id_ed25519"))
FADEN_SSH_CONNECT_TIMEOUT = env_int("FADEN_SSH_CONNECT_TIMEOUT", 10)
FADEN_SSH_COMMAND_TIMEOUT = env_int("FADEN_SSH_COMMAND_TIMEOUT", 120)
# The console's SSH certificate authority (machines/ssh_ca.py): its private key beside the console's own,
# and how long a certificate it signs for a node login is valid (at most a day: it cannot be revoked).
FADEN_SSH_CA_KEY_PATH = Path(os.environ.get("FADEN_SSH_CA_KEY_PATH", DATA_DIR / "ssh" / "ca_ed25519"))
FADEN_SSH_CERT_SECONDS = env_int("FADEN_SSH_CERT_SECONDS", 3600)
if not 60 <= FADEN_SSH_CERT_SECONDS <= 24 * 3600:
    raise ImproperlyConfigured("FADEN_SSH_CERT_SECONDS must be from 60 to 86400 (a day): a certificate cannot be revoked.")
# Node logins from people's computers: whether those reach the machines' SSH addresses themselves. When they
# do not, every ssh_command goes through FADEN_SSH_JUMP ([user@]host[:port], the console's host) as ProxyJump.
FADEN_MACHINES_REACHABLE = env_bool("FADEN_MACHINES_REACHABLE", True)
FADEN_SSH_JUMP = os.environ.get("FADEN_SSH_JUMP", "").strip()
# One word ssh reads as a destination: no blank, and nothing ssh would take for an option (a leading -).
_SSH_JUMP = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
if FADEN_SSH_JUMP and not _SSH_JUMP.fullmatch(FADEN_SSH_JUMP):
    raise ImproperlyConfigured("FADEN_SSH_JUMP must be [user@]host[:port], such as console.example.com or me@10.0.0.5:2222.")
if not FADEN_MACHINES_REACHABLE and not FADEN_SSH_JUMP:
    raise ImproperlyConfigured("FADEN_MACHINES_REACHABLE is false: set FADEN_SSH_JUMP to the console's host as people's "
                               "computers reach it over SSH ([user@]host[:port]), the jump to the machines.")

# At every start, whatever modes were there before: the data directory and all in it (0700, 0600),
# the SSH key, the SSH CA's key, the secrets' key and the SQLite file wherever they are.
# Secrets the console keeps (the Hugging Face token) are sealed with this key, kept outside the database.
FADEN_SECRETS_KEY_PATH = Path(os.environ.get("FADEN_SECRETS_KEY_PATH", DATA_DIR / "secrets.key"))
data_dir.private(DATA_DIR, secrets_elsewhere=[FADEN_SSH_KEY_PATH, FADEN_SSH_CA_KEY_PATH, FADEN_SECRETS_KEY_PATH], database=DATABASES["default"])

# Heartbeats: how machines reach the console, how often they beat, when they count as offline.
FADEN_CONSOLE_URL = os.environ.get("FADEN_CONSOLE_URL", "")
FADEN_WEB_PORT = env_int("FADEN_WEB_PORT", 8000)
FADEN_HEARTBEAT_INTERVAL = env_int("FADEN_HEARTBEAT_INTERVAL", 10)
FADEN_OFFLINE_AFTER = env_int("FADEN_OFFLINE_AFTER", 30)
# The agents' TLS listener (faden serve; the /agent/ endpoints only), with the certificate agents pin.
# FADEN_AGENT_TLS_URL: the https:// base URL agents use, when not the console's host on that port.
FADEN_AGENT_TLS_PORT = env_int("FADEN_AGENT_TLS_PORT", 8443)
if not 1 <= FADEN_AGENT_TLS_PORT <= 65535:
    raise ImproperlyConfigured(f"FADEN_AGENT_TLS_PORT must be a port from 1 to 65535, not {FADEN_AGENT_TLS_PORT}.")
FADEN_AGENT_TLS_APPLICATION = "config.agent_asgi.application"  # named for faden serve, like ASGI_APPLICATION
FADEN_AGENT_TLS_URL = os.environ.get("FADEN_AGENT_TLS_URL", "").rstrip("/")
if FADEN_AGENT_TLS_URL and not FADEN_AGENT_TLS_URL.startswith("https://"):
    raise ImproperlyConfigured("FADEN_AGENT_TLS_URL must be an https:// URL (the agents' TLS listener).")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("FADEN_LOG_LEVEL", "INFO")},
    "loggers": {"paramiko": {"level": "WARNING"}, "daphne": {"level": "WARNING"}, "axes": {"level": "WARNING"}},
}

# Static files are served by WhiteNoise from the collected folder, and straight from static/ before
# collectstatic has run (one process, no separate web server to configure).
WHITENOISE_USE_FINDERS = True
STATIC_ROOT.mkdir(parents=True, exist_ok=True)

# Models: the hub the server (and machines that download models themselves) get them from. HF_ENDPOINT is the
# variable huggingface_hub reads, so a mirror set for it is used here too; the lab points it at its stand-in hub.
FADEN_HF_ENDPOINT = (os.environ.get("FADEN_HF_ENDPOINT") or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
# The share of a copy's GPU memory kept for the KV cache, on top of the weights (the model page states it).
FADEN_KV_CACHE_SHARE = float(os.environ.get("FADEN_KV_CACHE_SHARE", "0.2"))
# Deployments: each machine gives copies ports from this range (inclusive) on its cluster address, and the
# console's placement chooses them. "8100-8199" by default; a site with other services there moves it.
FADEN_COPY_PORTS = tuple(int(p) for p in os.environ.get("FADEN_COPY_PORTS", "8100-8199").split("-", 1))
if len(FADEN_COPY_PORTS) != 2 or not 1024 <= FADEN_COPY_PORTS[0] <= FADEN_COPY_PORTS[1] <= 65535:
    raise ImproperlyConfigured("FADEN_COPY_PORTS must be a range of ports such as 8100-8199, from 1024 to 65535.")
# How long a copy may take to read Serving once its engine started (loading weights), before it is Failed.
FADEN_COPY_START_TIMEOUT = env_int("FADEN_COPY_START_TIMEOUT", 900)
# A drain (deployments/drain_job.py): the seconds a copy leaving a draining machine, out of the gateway's rotation,
# keeps answering the requests it holds before it stops; and after how long a copy that has not moved is said so.
FADEN_DRAIN_GRACE = env_int("FADEN_DRAIN_GRACE", 10)
FADEN_DRAIN_STUCK = env_int("FADEN_DRAIN_STUCK", 30 * 60)

# The gateway: the OpenAI-compatible front door to every serving copy, a process of its own (docs/gateway.md).
FADEN_GATEWAY_PORT = env_int("FADEN_GATEWAY_PORT", 8001)
FADEN_GATEWAY_BIND = os.environ.get("FADEN_GATEWAY_BIND", "")  # empty: where the web server listens (FADEN_WEB_BIND)
FADEN_GATEWAY_WORKERS = env_int("FADEN_GATEWAY_WORKERS", 1)  # processes behind the one port
# The URL clients use, as the Gateway page shows it; empty: the console's host name on FADEN_GATEWAY_PORT.
FADEN_GATEWAY_URL = os.environ.get("FADEN_GATEWAY_URL", "").rstrip("/")
FADEN_GATEWAY_APPLICATION = "config.gateway_asgi.application"  # named for faden serve, like ASGI_APPLICATION
FADEN_GATEWAY_REFRESH = float(os.environ.get("FADEN_GATEWAY_REFRESH", "0.5"))  # seconds between reads of routes and keys
FADEN_GATEWAY_PROBE = float(os.environ.get("FADEN_GATEWAY_PROBE", "1"))  # seconds between health looks at copies out of rotation
FADEN_GATEWAY_CONNECT_TIMEOUT = float(os.environ.get("FADEN_GATEWAY_CONNECT_TIMEOUT", "2"))
FADEN_GATEWAY_READ_TIMEOUT = float(os.environ.get("FADEN_GATEWAY_READ_TIMEOUT", "600"))  # a non-streamed answer
FADEN_GATEWAY_MAX_BODY = env_int("FADEN_GATEWAY_MAX_BODY", 32 * 1024 * 1024)
# Figures, failure reports and live processes in Redis (the database number of REDIS_URL applies).
FADEN_GATEWAY_REDIS_PREFIX = os.environ.get("FADEN_GATEWAY_REDIS_PREFIX", "faden:gateway")
# /metrics of the console and the gateway (docs/gateway.md, "Metrics"): the bearer token Prometheus sends (empty:
# the console's answers only a signed-in Administrator, the gateway's nobody); the gateway's without a token
# (for a gateway only a private network reaches); where a gateway's workers add up their figures.
FADEN_METRICS_TOKEN = os.environ.get("FADEN_METRICS_TOKEN", "").strip()
if FADEN_METRICS_TOKEN and len(FADEN_METRICS_TOKEN) < 16:
    raise ImproperlyConfigured("FADEN_METRICS_TOKEN must be at least 16 characters (openssl rand -hex 32 makes one).")
FADEN_GATEWAY_METRICS_OPEN = env_bool("FADEN_GATEWAY_METRICS_OPEN")
FADEN_GATEWAY_METRICS_DIR = Path(os.environ.get("FADEN_GATEWAY_METRICS_DIR", DATA_DIR / "gateway-metrics"))
# The gateway's bounds against a hostile client (docs/gateway.md, "Bounds"), per gateway process: a request's
# head at most MAX_HEAD bytes (431) and complete within HEAD_TIMEOUT s (408), MAX_CONNECTIONS connections (the
# longest idle one gives way to a new one), an idle kept-alive connection closed after KEEPALIVE s.
FADEN_GATEWAY_PROTOCOL = "deployments.gateway.protocol.BoundedHttpToolsProtocol"  # named for faden serve


def _gateway_bound(name: str, default, kind, low, high):
    raw = os.environ.get(name, "").strip()
    try:
        value = kind(raw) if raw else default
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a {'whole ' if kind is int else ''}number, not {raw!r}.") from None
    if not low <= value <= high:
        raise ImproperlyConfigured(f"{name} must be from {low:g} to {high:g}; it is {value:g}.")
    return value


FADEN_GATEWAY_MAX_HEAD = _gateway_bound("FADEN_GATEWAY_MAX_HEAD", 64 * 1024, int, 4 * 1024, 1024 * 1024)
FADEN_GATEWAY_HEAD_TIMEOUT = _gateway_bound("FADEN_GATEWAY_HEAD_TIMEOUT", 5.0, float, 0.5, 120)
FADEN_GATEWAY_MAX_CONNECTIONS = _gateway_bound("FADEN_GATEWAY_MAX_CONNECTIONS", 4096, int, 16, 1_000_000)
FADEN_GATEWAY_KEEPALIVE = _gateway_bound("FADEN_GATEWAY_KEEPALIVE", 5, int, 1, 3600)
# Cache-aware routing (docs/gateway.md), per gateway process: keys of prompts' prefixes its index keeps (about
# 210 bytes each; the oldest go first), the requests in flight a copy holding a prompt's prefix may have above
# the least busy copy before the request goes to the least busy instead, and the characters of a prompt's block.
FADEN_GATEWAY_PREFIX_ENTRIES = _gateway_bound("FADEN_GATEWAY_PREFIX_ENTRIES", 100_000, int, 1_000, 100_000_000)
FADEN_GATEWAY_PREFIX_BOUND = _gateway_bound("FADEN_GATEWAY_PREFIX_BOUND", 8, int, 0, 1_000_000)
FADEN_GATEWAY_PREFIX_BLOCK = _gateway_bound("FADEN_GATEWAY_PREFIX_BLOCK", 256, int, 16, 65_536)

# The cluster's firewall (clusters/firewall.py, docs/network.md): addresses or networks, comma-separated, that
# the copies' and the file servers' ports let in besides the members, the console and the gateway as the
# console finds them (a console behind NAT, a gateway on another host).
FADEN_FIREWALL_ALLOW = [a.strip() for a in os.environ.get("FADEN_FIREWALL_ALLOW", "").split(",") if a.strip()]

# The console's TLS certificate authority (console/pki.py, docs/https-and-trust.md): its files in the data
# directory's tls/ (the private keys sealed with the secrets key), and how long a certificate it signs for a
# machine's cluster address (Ray, copies) or for the console's own client is valid; renewed with a third left.
FADEN_TLS_DIR = Path(os.environ.get("FADEN_TLS_DIR", DATA_DIR / "tls"))
FADEN_CERT_DAYS = env_int("FADEN_CERT_DAYS", 30)
if not 1 <= FADEN_CERT_DAYS <= 397:
    raise ImproperlyConfigured("FADEN_CERT_DAYS must be from 1 to 397 (what browsers accept for a server certificate).")
CELERY_BEAT_SCHEDULE["clusters-certificates-renew"] = {"task": "clusters.tasks.certificates_renew", "schedule": timedelta(hours=1)}
