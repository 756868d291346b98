"""The server's one client of the agent on each machine.

This is the only place that builds an agent command line or reads an agent's
result: every command is a typed method, every result a value the callers read
by attribute. The agent answers in JSON lines (``agent/fadenstack_agent/protocol.py``);
``machines.remote`` carries them over SSH.

    with Agent.open(machine) as agent:
        status = agent.runtime_status()

Unit tests replace ``Agent.open`` with a fake that answers from a script.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

from fabric import Connection

from machines import remote
from machines.models import Machine
from machines.services import machine_target


class AgentErrorKind(StrEnum):
    """The kinds of the agent's ``error`` events (the agent's own list is ``protocol.KINDS``)."""

    RETRYABLE = "retryable"  # try again later: the same call may succeed
    NOT_RETRYABLE = "not_retryable"  # the same cause comes out of every retry: a person must act
    ADDRESS_IN_USE = "address_in_use"  # a port the command needs is taken
    NO_ROOM = "no_room"  # the machine's store has no room for the file
    UNREACHABLE = "unreachable"  # the machine, or the one it fetches from, does not answer
    BAD_INPUT = "bad_input"  # the server sent something the agent refuses: a bug on our side


AgentError = remote.RemoteError  # what every method raises: ``message`` in words, ``kind`` one of AgentErrorKind

Progress = Callable[[dict], None]
Abort = Callable[[], str | None]


@dataclass(frozen=True)
class RayNode:
    address: str
    alive: bool
    gpus: int
    node_id: str


@dataclass(frozen=True)
class RayStatus:
    """Ray's node list, as the head reports it."""

    nodes: tuple[RayNode, ...]
    alive_nodes: int | None
    gpus: int | None
    raw: dict = field(repr=False)

    def alive(self) -> dict[str, RayNode]:
        """The live nodes by their address."""
        return {n.address: n for n in self.nodes if n.alive}


@dataclass(frozen=True)
class RuntimeStatus:
    """The machine's runtime (its container) and the Ray inside it."""

    state: str  # started, stopped, ...
    digest: str  # the image it runs
    ray_running: bool
    gcs_address: str  # the Ray head the local Ray belongs to
    raw: dict = field(repr=False)  # kept as the health check's raw status


@dataclass(frozen=True)
class HeartbeatStarted:
    """What ``heartbeat start`` did: the daemon's pid, and whether a running one was replaced."""

    pid: int | None
    restarted: bool


@dataclass(frozen=True)
class HeartbeatStatus:
    """The heartbeat daemon as the machine sees it: running or not, and on which agent version."""

    running: bool
    configured: bool
    pid: int | None
    version: str  # the agent version the running daemon reported; "" when it is not running


@dataclass(frozen=True)
class FileSource:
    """Where a machine fetches a file from: the server (with a download token) or another machine."""

    url: str
    token: str = ""


@dataclass(frozen=True)
class FileSpec:
    """A content-addressed file: its sha256, size and the sha256 of each chunk (resumes check them)."""

    digest: str
    size: int
    chunk_size: int
    chunk_hashes: list[str] = field(repr=False)


@dataclass(frozen=True)
class ModelFile:
    """One file of a model: its path in the repo, its sha256 and size (the blob it is placed from)."""

    path: str
    digest: str
    size: int


@dataclass(frozen=True)
class ModelSpec:
    """A model revision as the agent places it: ``<store>/models/<org>--<name>/<revision>/<path>``."""

    repo: str  # "org/name" on the hub
    revision: str  # a commit sha (or a branch or tag without "/")
    files: tuple[ModelFile, ...] = field(repr=False)

    def as_json(self) -> dict:
        return {"repo": self.repo, "revision": self.revision,
                "files": [{"path": f.path, "digest": f.digest, "size": f.size} for f in self.files]}


@dataclass(frozen=True)
class PlacedModel:
    """A model placed on a machine: where its tree is, its bytes and number of files."""

    repo: str
    revision: str
    path: str
    bytes: int
    files: int
    bytes_downloaded: int = 0  # what ``model download`` brought from the hub this time (resumed bytes not counted)


@dataclass(frozen=True)
class ModelList:
    """The models placed on a machine, and the room left in its store."""

    models: tuple[PlacedModel, ...]
    free_bytes: int


@dataclass(frozen=True)
class HubCheck:
    """A machine's own GET of the hub's model list answered: its status and how long it took."""

    ok: bool
    status: int
    seconds: float


@dataclass(frozen=True)
class CopyStatus:
    """A copy of a model as its machine's agent sees it: its engine's process and whether it answers."""

    copy: str
    running: bool
    healthy: bool
    pid: int | None
    port: int | None
    log_tail: str  # the engine's last lines (its own words when it failed)


@dataclass(frozen=True)
class NodeFilesChange:
    """What ``node files write`` or ``node files remove`` did on a machine: the files it changed (paths
    as the machine names them) and what became of sshd."""

    changed: bool  # False: everything was already so (a write of the same spec, a second remove)
    paths: tuple[str, ...]
    sshd_reloaded: str  # how sshd was told ("SIGHUP to sshd (pid 812)"); "" when none of its files changed or none runs
    include_added: bool  # the sshd configuration had no Include of the drop-in and holds the agent's own (write only)
    warnings: tuple[str, ...]  # the machine's sentences: no running sshd, certificate logins still off
    raw: dict = field(repr=False)


@dataclass(frozen=True)
class AllReduceResult:
    """How the head's ``allreduce run`` ended: all_reduce_perf's exit status (under mpirun; 128 + the signal
    when it was ended by one), whether the run's own timeout ended it, and the last lines it wrote on stderr
    (mpirun's and the ranks' own words when it failed)."""

    exit_status: int
    timed_out: bool
    stderr_tail: tuple[str, ...]


@dataclass(frozen=True)
class SharedStatus:
    """What ``/shared`` is on a machine (``shared status``) and which network file systems it can serve or
    mount it with: ``can`` names ``nfs_export``, ``nfs_mount`` and ``sshfs``; ``cannot`` says why not."""

    mounted: bool  # a network file system is mounted on /shared
    method: str  # "nfs" or "sshfs" when it is one of those; "" otherwise
    source: str  # what is mounted ("root@198.18.1.10:/shared"); "" when nothing is
    alive: bool | None  # the mount answers; False: dead ("Transport endpoint is not connected"); None: no mount
    role: str  # "head" or "node" as the agent last made it; "" when it made neither
    can: dict[str, bool]
    cannot: dict[str, str]
    raw: dict = field(repr=False)


@dataclass(frozen=True)
class SharedChange:
    """What ``shared export``, ``mount`` or ``unmount`` did on a machine."""

    changed: bool  # False: it was so already (a live mount of the same source, nothing to unmount)
    method: str  # the method exported or mounted ("" for an unmount of nothing)
    remounted: bool  # a dead mount was unmounted and mounted again
    kept: str  # the head keeps its files here ("/shared") after an unmount; "" elsewhere
    warnings: tuple[str, ...]
    raw: dict = field(repr=False)


def _shared_status(raw: dict) -> SharedStatus:
    return SharedStatus(mounted=bool(raw.get("mounted")), method=str(raw.get("method") or ""),
                        source=str(raw.get("source") or ""), alive=raw.get("alive"), role=str(raw.get("role") or ""),
                        can={str(k): bool(v) for k, v in (raw.get("can") or {}).items()},
                        cannot={str(k): str(v) for k, v in (raw.get("cannot") or {}).items()}, raw=raw)


def _shared_change(raw: dict) -> SharedChange:
    changed = bool(raw.get("changed", raw.get("unmounted") or raw.get("unexported")))
    return SharedChange(changed=changed, method=str(raw.get("method") or ""), remounted=bool(raw.get("remounted")),
                        kept=str(raw.get("kept") or ""), warnings=tuple(str(w) for w in raw.get("warnings") or ()), raw=raw)


def _node_files(raw: dict) -> NodeFilesChange:
    sshd = raw.get("sshd") or {}
    return NodeFilesChange(changed=bool(raw.get("changed")), paths=tuple(str(p) for p in raw.get("paths") or ()),
                           sshd_reloaded=str(sshd.get("reloaded") or ""), include_added=bool(sshd.get("include_added")),
                           warnings=tuple(str(w) for w in raw.get("warnings") or ()), raw=raw)


def _copy_status(raw: dict) -> CopyStatus:
    lines = raw.get("log_tail") or raw.get("log") or ""
    return CopyStatus(copy=str(raw.get("copy") or ""), running=bool(raw.get("running")), healthy=bool(raw.get("healthy")),
                      pid=raw.get("pid"), port=raw.get("port"),
                      log_tail="\n".join(lines) if isinstance(lines, list) else str(lines))


def _placed(raw: dict) -> PlacedModel:
    return PlacedModel(repo=str(raw.get("repo", "")), revision=str(raw.get("revision", "")), path=str(raw.get("path", "")),
                       bytes=int(raw.get("bytes") or 0), files=int(raw.get("files") or 0),
                       bytes_downloaded=int(raw.get("bytes_downloaded") or 0))


def _driver(driver: str) -> list[str]:
    return ["--driver", driver] if driver else []


def _ray_status(raw: dict) -> RayStatus:
    nodes = tuple(
        RayNode(address=str(n.get("address", "")), alive=bool(n.get("alive")), gpus=int(n.get("gpus") or 0),
                node_id=str(n.get("node_id", ""))[:64])
        for n in raw.get("nodes") or []
    )
    return RayStatus(nodes=nodes, alive_nodes=raw.get("alive_nodes"), gpus=raw.get("gpus"), raw=raw)


def _runtime_status(raw: dict) -> RuntimeStatus:
    ray = raw.get("ray") or {}
    return RuntimeStatus(state=str(raw.get("state", "")), digest=str(raw.get("digest") or ""),
                         ray_running=bool(ray.get("running")), gcs_address=str(ray.get("gcs_address") or ""), raw=raw)


class Agent:
    """The agent on one machine, over one open SSH connection."""

    def __init__(self, machine: Machine, conn: Connection, *, argv: list[str] | None = None):
        self.machine = machine
        self.conn = conn
        self._argv = argv  # the agent's argv, when it differs from the machine's row (during enrolment)

    @classmethod
    @contextmanager
    def open(cls, machine: Machine) -> Iterator[Agent]:
        """Connect to the machine (its host key pinned) and hand out its agent."""
        if not machine.agent_path:
            raise AgentError(f"{machine.name} has no agent yet: refresh its facts.", kind=AgentErrorKind.NOT_RETRYABLE)
        with remote.connect(machine_target(machine)) as conn:
            yield cls(machine, conn)

    def _call(self, *args: str, timeout: float | None = None, stdin: bytes | None = None,
              on_progress: Progress | None = None, abort: Abort | None = None) -> dict:
        argv = [*(self._argv or [self.machine.python_path or "python3", self.machine.agent_path]), *args]
        on_event = (lambda event: on_progress(event) if event.get("event") == "progress" else None) if on_progress else None
        return remote.run_agent(self.conn, argv, timeout=timeout, stdin=stdin, on_event=on_event, abort=abort)

    def host_key(self) -> str:
        """The machine's host key as this connection received it, which ``remote.connect`` has checked
        against the pinned fingerprint: one public key line (``ssh-ed25519 AAAA...``), for the cluster's
        known_hosts (clusters/node_files.py)."""
        key = self.conn.client.get_transport().get_remote_server_key()
        return f"{key.get_name()} {key.get_base64()}"

    def console_url(self) -> str:
        """The console's URL as this machine sees it (where it downloads from and sends heartbeats to)."""
        return remote.console_url(self.conn)

    # -- facts and the heartbeat (enrolment) ---------------------------------------------------

    def facts(self) -> dict:
        return self._call("facts")["facts"]

    def heartbeat_start(self, *, url: str, interval: int, token: str) -> HeartbeatStarted:
        """Start the heartbeat daemon; the token goes on stdin, never on a command line. A daemon of
        another agent version or configuration is stopped (that process alone) and started again."""
        result = self._call("heartbeat", "start", "--url", url, "--interval", str(interval), stdin=token.encode() + b"\n")
        return HeartbeatStarted(pid=result.get("pid"), restarted=bool(result.get("restarted")))

    def heartbeat_status(self) -> HeartbeatStatus:
        result = self._call("heartbeat", "status", timeout=30)
        return HeartbeatStatus(running=bool(result.get("running")), configured=bool(result.get("configured")),
                               pid=result.get("pid"), version=str(result.get("version") or ""))

    def version(self) -> str:
        """The version of the agent this client runs (its ``version`` command)."""
        return str(self._call("version", timeout=30).get("version") or "")

    # -- files: fetched with resume, served to the next machine --------------------------------

    def file_fetch(self, spec: FileSpec, source: FileSource, *, timeout: float, on_progress: Progress | None = None,
                   abort: Abort | None = None) -> int:
        """Fetch a file into the machine's store, chunk by verified chunk, resuming what an earlier try
        left; the bytes that crossed the network (resends included)."""
        body = {"digest": spec.digest, "size": spec.size, "chunk_size": spec.chunk_size, "chunk_hashes": spec.chunk_hashes,
                "source": {"url": source.url, **({"token": source.token} if source.token else {})}}
        result = self._call("blob", "fetch", stdin=json.dumps(body).encode(), timeout=timeout, on_progress=on_progress, abort=abort)
        return int(result.get("bytes_fetched", 0))

    def serve_start(self, *, bind: str, port: int) -> None:
        """Serve the files this machine holds to the others, on the cluster's network."""
        self._call("blob", "serve", "start", "--bind", bind, "--port", str(port), timeout=30)

    def serve_stop(self) -> None:
        self._call("blob", "serve", "stop", timeout=60)

    # -- models: placed from blobs, or downloaded from the hub by the machine itself ---------------

    def model_place(self, spec: ModelSpec, *, timeout: float = 300) -> PlacedModel:
        """Lay out a model whose files are blobs on the machine (``file_fetch``) as the tree an engine
        reads; refused (not_retryable) while a file is missing. Placing it again is harmless."""
        return _placed(self._call("model", "place", stdin=json.dumps(spec.as_json()).encode(), timeout=timeout))

    def model_list(self) -> ModelList:
        result = self._call("model", "list", timeout=60)
        return ModelList(models=tuple(_placed(m) for m in result.get("models") or []),
                         free_bytes=int(result.get("free_bytes") or 0))

    def model_remove(self, *, repo: str, revision: str) -> int:
        """Remove a placed model and the files no other model on the machine uses; the bytes freed (0 when
        it was not there)."""
        return int(self._call("model", "remove", "--repo", repo, "--revision", revision, timeout=300).get("freed") or 0)

    def model_download(self, spec: ModelSpec, *, endpoint: str, token: str = "", timeout: float,
                       on_progress: Progress | None = None, abort: Abort | None = None) -> PlacedModel:
        """Have the machine download the model's missing files from the hub at ``endpoint`` (resuming what an
        earlier try left), then place it. The token goes inside the stdin JSON, never on a command line."""
        body = {**spec.as_json(), "endpoint": endpoint, **({"token": token} if token else {})}
        return _placed(self._call("model", "download", stdin=json.dumps(body).encode(), timeout=timeout,
                                  on_progress=on_progress, abort=abort))

    def hub_check(self, url: str, *, timeout: float = 5) -> HubCheck:
        """Whether the machine itself reaches the hub at ``url`` (raises unreachable, in words, when not)."""
        result = self._call("hub", "check", "--url", url, "--timeout", f"{timeout:g}", timeout=timeout + 30)
        return HubCheck(ok=bool(result.get("ok")), status=int(result.get("status") or 0),
                        seconds=float(result.get("seconds") or 0.0))

    # -- copies of models: the engine inside the runtime container, on the GPUs placement gave it ----

    def copy_start(self, *, copy: str, cluster: str, env: dict[str, str], address: str, argv: list[str] | None = None,
                   port: int | None = None, ray: dict | None = None) -> CopyStatus:
        """Start a copy's engine (detached: it outlives this connection and the console's processes), or with
        ``ray`` (``{"head": None | "addr:port", "gpus": N}``) a node of a spanning copy's own Ray, whose
        ``port`` in the answer is its head's GCS port. The whole spec goes on stdin; starting a copy that
        already runs with the same spec is harmless."""
        body = {"copy": copy, "cluster": cluster, "env": env, "address": address}
        body |= {"ray": ray} if ray is not None else {"argv": argv, "port": port}
        return _copy_status(self._call("copy", "start", stdin=json.dumps(body).encode(), timeout=120))

    def copy_stop(self, copy: str, *, timeout: int = 30) -> None:
        """Stop a copy's engine (SIGTERM, then SIGKILL); stopping one that is not running succeeds."""
        self._call("copy", "stop", "--copy", copy, "--timeout", str(timeout), timeout=timeout + 60)

    def copy_logs(self, copy: str, *, lines: int = 50) -> list[str]:
        """The last lines of a copy's engine log on this machine."""
        return list(self._call("copy", "logs", "--copy", copy, "--lines", str(lines), timeout=60).get("lines") or [])

    def copy_list(self) -> list[CopyStatus]:
        """Every copy the machine runs or ran, with whether its engine answers its health endpoint."""
        return [_copy_status(raw) for raw in self._call("copy", "list", timeout=60).get("copies") or []]

    # -- the runtime ----------------------------------------------------------------------------

    def image_load(self, digest: str, *, driver: str, abort: Abort | None = None) -> None:
        """Load image D into the runtime ``driver`` (the machine's runtime in use; its agent config's
        own driver wins, as in the lab). Without one the agent picks, and says there is none."""
        self._call("image", "load", "--digest", digest, *_driver(driver), timeout=120, abort=abort)

    def runtime_start(self, digest: str, *, driver: str, cluster: str, abort: Abort | None = None) -> None:
        """Start the runtime of the loaded image D with ``driver``; the container is named after the
        cluster (``fadenstack-<cluster>``) and labelled with it."""
        self._call("runtime", "start", "--digest", digest, *_driver(driver), "--cluster", cluster, timeout=120, abort=abort)

    def runtime_stop(self) -> None:
        """Stop Ray and the runtime; a no-op where nothing runs."""
        self._call("runtime", "stop", timeout=90)

    def runtime_status(self) -> RuntimeStatus:
        return _runtime_status(self._call("runtime", "status", timeout=30))

    # -- Ray ------------------------------------------------------------------------------------

    def ray_start_head(self, *, address: str, port: int, gpus: int) -> RayStatus:
        """Start Ray's head; Ray's node list as it was once the head read alive."""
        return _ray_status(self._call("ray", "start-head", "--address", address, "--port", str(port), "--num-gpus", str(gpus),
                                      timeout=180))

    def ray_join(self, *, head: str, address: str, gpus: int, abort: Abort | None = None) -> RayStatus:
        """Join the head's cluster; Ray's node list as it was once this machine read alive."""
        return _ray_status(self._call("ray", "join", "--head", head, "--address", address, "--num-gpus", str(gpus), timeout=180,
                                      abort=abort))

    def ray_status(self, *, head: str, timeout: float = 60) -> RayStatus:
        return _ray_status(self._call("ray", "status", "--head", head, timeout=timeout))

    def ray_reach(self, *, head: str) -> None:
        """Whether this machine reaches the head's Ray port (raises when not)."""
        self._call("ray", "reach", "--head", head, timeout=30)

    def ray_stop(self, *, abort: Abort | None = None) -> None:
        self._call("ray", "stop", timeout=60, abort=abort)

    # -- a cluster's files on its machines: hostfile, settings, hosts, node-to-node SSH, sshd's trust ----

    def node_files_write(self, spec: Mapping) -> NodeFilesChange:
        """Put a member's cluster files in place (``clusters.node_files.node_files_spec`` builds the spec).
        The spec goes on stdin, never on a command line: it holds the cluster's private node key. sshd
        refusing the change is not_retryable with sshd's words, and the machine keeps its previous files."""
        return _node_files(self._call("node", "files", "write", stdin=json.dumps(spec).encode(), timeout=120))

    def node_files_remove(self) -> NodeFilesChange:
        """Take a machine's cluster files away again (it left the cluster, or the cluster is deleted), every
        file it shares with the machine byte for byte as it was; harmless when there are none."""
        return _node_files(self._call("node", "files", "remove", timeout=120))

    # -- /shared: on the head, mounted on every other node over the cluster's network ---------------

    def shared_status(self) -> SharedStatus:
        """What /shared is on the machine, and whether it can export it with NFS, mount NFS, or mount sshfs."""
        return _shared_status(self._call("shared", "status", timeout=30))

    def shared_export(self, *, method: str, allow_from: str) -> SharedChange:
        """Make the machine the head of /shared (1777, the hostfile copied in); with ``nfs`` exported to the
        cluster's subnet ``allow_from`` only."""
        return _shared_change(self._call("shared", "export", "--method", method, "--allow-from", allow_from, timeout=120))

    def shared_mount(self, *, head: str, method: str) -> SharedChange:
        """Mount the head's /shared on /shared (``head``: its address on the cluster's network); a live mount of
        the same source changes nothing, a dead one is mounted again. A head that does not answer is unreachable."""
        return _shared_change(self._call("shared", "mount", "--head", head, "--method", method, timeout=120))

    def image_remove(self) -> dict:
        """Free the runtime images in the machine's store but the one its started runtime runs (agent 0.9):
        ``{"removed": [{"digest", "size"}], "kept": [{"digest", "why"}], "freed", "warnings"}``."""
        return self._call("image", "remove", timeout=300)

    def shared_clear(self) -> dict:
        """Empty the /shared a deleted cluster left on its former head (agent 0.9): ``{"removed", "freed"}``."""
        return self._call("shared", "clear", timeout=300)

    def shared_unmount(self) -> SharedChange:
        """Take /shared away as the agent made it: a node's mount goes, the head's export goes and its files stay."""
        return _shared_change(self._call("shared", "unmount", timeout=120))

    # -- the NCCL test: all_reduce_perf across the nodes, under mpirun in the head's runtime -----------

    def allreduce_run(self, spec: Mapping, *, on_line: Callable[[str], None], abort: Abort | None = None,
                      timeout: float) -> AllReduceResult:
        """Run the NCCL test from the head (this agent's machine) across ``spec["nodes"]``; every line the run
        prints goes to ``on_line`` as it is printed. ``abort`` (or the connection's ``timeout``) closes the
        session, which ends the run on every node; the spec's own ``timeout`` ends it too, as a result with
        ``timed_out``. Another run on this machine is refused (retryable, naming it)."""
        def line_of(event: dict) -> None:
            if isinstance(event.get("line"), str):
                on_line(event["line"])

        result = self._call("allreduce", "run", stdin=json.dumps(spec).encode(), timeout=timeout,
                            on_progress=line_of, abort=abort)
        return AllReduceResult(exit_status=int(result.get("exit_status", -1)), timed_out=bool(result.get("timed_out")),
                               stderr_tail=tuple(str(line) for line in result.get("stderr_tail") or ()))

    # -- the network test -------------------------------------------------------------------------

    def probe_serve(self, *, bind: str, port: int, seconds: int) -> None:
        self._call("probe", "serve", "--bind", bind, "--port", str(port), "--seconds", str(seconds), timeout=seconds + 30)

    def probe_send(self, *, to: str, port: int, seconds: int) -> float:
        """Send to a machine's probe server for ``seconds``; the measured Mbit/s."""
        result = self._call("probe", "send", "--to", to, "--port", str(port), "--seconds", str(seconds), timeout=seconds + 30)
        return float(result["mbps"])
