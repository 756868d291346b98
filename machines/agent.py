"""The server side of the agent: build its zipapp, install it on a machine, run its commands.

The server never imports the agent's code: it zips the ``agent/`` folder into a
versioned zipapp and speaks to it through its command line (JSON lines).
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from fabric import Connection

from console.choices import ErrorKind
from console.files import writer_temporary
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


@functools.cache  # read on every row of the machines list; the build is cached the same way
def agent_version() -> str:
    """The version of the agent this console ships (and installs), from the agent's VERSION file."""
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
        archive.writestr(main, (AGENT_SOURCE / "zipmain.py").read_bytes())  # runs the package unpacked beside the zip
    content = data.getvalue()
    digest = hashlib.sha256(content).hexdigest()
    out_dir = Path(settings.DATA_DIR) / "agent-builds"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"fadenstack-agent-{version}-{digest[:12]}.pyz"
    if not path.exists():
        # A name of this writer's own: enrolments in several worker processes may build at once.
        tmp = writer_temporary(path)
        tmp.write_bytes(content)
        tmp.replace(path)
    return AgentBuild(version=version, path=path, sha256=digest)


# One round trip before installing: which Python, where the agent goes, whether this build is
# already there, and the address the console's SSH session comes from (for heartbeats).
_PREFLIGHT = r"""
import hashlib, json, os, sys
filename = sys.argv[1]
home = "/opt/fadenstack" if os.getuid() == 0 else os.path.join(os.path.expanduser("~"), ".fadenstack")
directory = os.path.join(home, "agent")
path = os.path.join(directory, filename)
digest = None
if os.path.exists(path):
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
else:
    os.makedirs(directory, exist_ok=True)
print(json.dumps({"python": os.path.realpath(sys.executable), "version": "%d.%d.%d" % sys.version_info[:3],
                  "supported": sys.version_info >= (3, 9), "path": path, "sha256": digest,
                  "ssh_connection": os.environ.get("SSH_CONNECTION", "")}))
"""

# Check the uploaded file's digest and put it in place in one step.
_VERIFY_AND_MOVE = r"""
import hashlib, os, sys
partial, final, expected = sys.argv[1:4]
with open(partial, "rb") as f:
    got = hashlib.sha256(f.read()).hexdigest()
if got != expected:
    os.unlink(partial)
    sys.exit("sha256 " + got)
os.chmod(partial, 0o644)
os.replace(partial, final)
"""


@dataclass(frozen=True)
class Preflight:
    python: str
    version: str
    path: str  # where this build of the agent lives on the machine
    installed: bool  # that file is there with the build's digest
    ssh_client_address: str  # the console's address as the machine sees it


def machine_preflight(conn: Connection, build: AgentBuild) -> Preflight:
    """Python 3.9 or newer, the agent's place, and whether this build is already installed."""
    result = remote.run(conn, ["python3", "-c", _PREFLIGHT, build.filename])
    if result.exit_status == 127:
        raise remote.RemoteError("The machine has no python3; the agent needs Python 3.9 or newer.", kind=ErrorKind.NOT_RETRYABLE)
    try:
        found = json.loads(result.stdout)
    except ValueError:
        words = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise remote.RemoteError(f"python3 on the machine failed: {words}", kind=ErrorKind.NOT_RETRYABLE) from None
    if not found["supported"]:
        raise remote.RemoteError(f"The machine has Python {found['version']}; the agent needs 3.9 or newer.", kind=ErrorKind.NOT_RETRYABLE)
    return Preflight(
        python=found["python"],
        version=found["version"],
        path=found["path"],
        installed=found["sha256"] == build.sha256,
        ssh_client_address=(found["ssh_connection"].split() or [""])[0],
    )


def agent_install(conn: Connection, build: AgentBuild, preflight: Preflight) -> bool:
    """Put the build on the machine over SFTP, digest checked; returns whether it had to be copied."""
    if preflight.installed:
        return False
    partial = f"{preflight.path}.part"
    remote.upload(conn, build.path, partial)
    result = remote.run(conn, [preflight.python, "-c", _VERIFY_AND_MOVE, partial, preflight.path, build.sha256])
    if result.exit_status != 0:
        got = result.stderr.strip().splitlines()[-1:] or ["unreadable"]
        raise remote.RemoteError(f"The agent arrived damaged ({got[0]}, expected {build.sha256}); try again.")
    return True
