"""The server side of the agent: build its zipapp, install it on a machine, run its commands.

The server never imports the agent's code: it zips the ``agent/`` folder into a
versioned zipapp and speaks to it through its command line (JSON lines).
"""
from __future__ import annotations

import functools
import hashlib
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from django.conf import settings
from fabric import Connection

from machines import remote

AGENT_SOURCE = Path(settings.BASE_DIR) / "agent"
PACKAGE = "fadenstack_agent"
# Fixed timestamps make the build reproducible: the same source gives the same digest.
_EPOCH = (2026, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class AgentBuild:
    version: str
    path: Path
    sha256: str

    @property
    def filename(self) -> str:
        return f"fadenstack-agent-{self.version}.pyz"


def agent_version() -> str:
    return (AGENT_SOURCE / PACKAGE / "VERSION").read_text().strip()


@functools.cache
def agent_build() -> AgentBuild:
    """Build the agent's zipapp once per process into the data directory."""
    version = agent_version()
    data = io.BytesIO()
    data.write(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(data, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        for file in sorted((AGENT_SOURCE / PACKAGE).rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts:
                info = zipfile.ZipInfo(str(file.relative_to(AGENT_SOURCE)), date_time=_EPOCH)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = 0o644 << 16
                archive.writestr(info, file.read_bytes())
        main = zipfile.ZipInfo("__main__.py", date_time=_EPOCH)
        main.compress_type = zipfile.ZIP_DEFLATED
        archive.writestr(main, f"import sys\nfrom {PACKAGE}.__main__ import main\nsys.exit(main())\n")
    content = data.getvalue()
    digest = hashlib.sha256(content).hexdigest()
    out_dir = Path(settings.DATA_DIR) / "agent-builds"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"fadenstack-agent-{version}-{digest[:12]}.pyz"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(content)
        tmp.replace(path)
    return AgentBuild(version=version, path=path, sha256=digest)


def agent_home(conn: Connection) -> PurePosixPath:
    """Where the agent lives on the machine: /opt/fadenstack as root, ~/.fadenstack otherwise."""
    uid = remote.run(conn, ["id", "-u"]).stdout.strip()
    if uid == "0":
        return PurePosixPath("/opt/fadenstack")
    home = remote.run(conn, ["printenv", "HOME"]).stdout.strip()
    if not home.startswith("/"):
        raise remote.RemoteError("The SSH user has no home directory to install the agent in.", kind="not_retryable")
    return PurePosixPath(home) / ".fadenstack"


def _remote_sha256(conn: Connection, path: str) -> str | None:
    result = remote.run(conn, ["sha256sum", "--", path])
    return result.stdout.split()[0] if result.exit_status == 0 and result.stdout else None


def agent_install(conn: Connection, build: AgentBuild) -> tuple[str, bool]:
    """Put the build on the machine, digest checked; a build already there is left alone.

    Returns the installed path and whether it had to be uploaded.
    """
    directory = agent_home(conn) / "agent"
    final = str(directory / build.filename)
    if remote.run(conn, ["mkdir", "-p", "--", str(directory)]).exit_status != 0:
        raise remote.RemoteError(f"Could not create {directory} on the machine.", kind="not_retryable")
    if _remote_sha256(conn, final) == build.sha256:
        return final, False
    partial = f"{final}.part"
    remote.upload(conn, build.path, partial)
    got = _remote_sha256(conn, partial)
    if got != build.sha256:
        remote.run(conn, ["rm", "-f", "--", partial])
        raise remote.RemoteError(f"The agent arrived damaged (sha256 {got}, expected {build.sha256}); try again.")
    remote.run(conn, ["mv", "-f", "--", partial, final])
    return final, True


def python_check(conn: Connection) -> str:
    """The machine's python3 version; the agent needs 3.9 or newer."""
    result = remote.run(
        conn, ["python3", "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3]); sys.exit(sys.version_info < (3, 9))"]
    )
    version = result.stdout.strip()
    if result.exit_status == 127 or not version:
        raise remote.RemoteError("The machine has no python3; the agent needs Python 3.9 or newer.", kind="not_retryable")
    if result.exit_status != 0:
        raise remote.RemoteError(f"The machine has Python {version}; the agent needs 3.9 or newer.", kind="not_retryable")
    return version
