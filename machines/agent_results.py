"""What the agent's commands answer, as values the server reads by attribute, and the parsers that make them.

``machines/agent_client.py`` sends the commands; each of its methods hands the command's JSON result to
one ``..._from`` function here (a field the answer lacks reads as empty, zero or False); ``raw`` keeps
the whole answer where a page or a health check shows more than the fields. Tests' fake agents build
these values too (tests/fakes.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    # What the machine recorded when it started the engine (Look for them reads it for engines no record knows).
    cluster: str = ""
    address: str = ""
    started_at: float | None = None  # seconds since the epoch
    argv: tuple[str, ...] = ()
    env_names: tuple[str, ...] = ()
    gpus: tuple[int, ...] | None = None  # the GPU indices its environment shows it; None: not said (older agent)


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


@dataclass(frozen=True)
class ImagesRemoved:
    """What ``image remove`` freed: the runtime images gone, those kept (and why), the bytes freed."""

    removed: tuple[str, ...]  # the digests removed
    kept: tuple[tuple[str, str], ...]  # (digest, why it stays)
    freed: int
    warnings: tuple[str, ...]
    raw: dict = field(repr=False)


@dataclass(frozen=True)
class SharedCleared:
    """What ``shared clear`` removed from a former head's /shared."""

    removed: int  # files and directories
    freed: int  # bytes
    raw: dict = field(repr=False)


def images_removed_from(raw: dict) -> ImagesRemoved:
    return ImagesRemoved(removed=tuple(str(r.get("digest") or "") for r in raw.get("removed") or ()),
                         kept=tuple((str(k.get("digest") or ""), str(k.get("why") or "")) for k in raw.get("kept") or ()),
                         freed=int(raw.get("freed") or 0), warnings=tuple(str(w) for w in raw.get("warnings") or ()), raw=raw)


def shared_cleared_from(raw: dict) -> SharedCleared:
    return SharedCleared(removed=int(raw.get("removed") or 0), freed=int(raw.get("freed") or 0), raw=raw)


def shared_status_from(raw: dict) -> SharedStatus:
    return SharedStatus(mounted=bool(raw.get("mounted")), method=str(raw.get("method") or ""),
                        source=str(raw.get("source") or ""), alive=raw.get("alive"), role=str(raw.get("role") or ""),
                        can={str(k): bool(v) for k, v in (raw.get("can") or {}).items()},
                        cannot={str(k): str(v) for k, v in (raw.get("cannot") or {}).items()}, raw=raw)


def shared_change_from(raw: dict) -> SharedChange:
    changed = bool(raw.get("changed", raw.get("unmounted") or raw.get("unexported")))
    return SharedChange(changed=changed, method=str(raw.get("method") or ""), remounted=bool(raw.get("remounted")),
                        kept=str(raw.get("kept") or ""), warnings=tuple(str(w) for w in raw.get("warnings") or ()), raw=raw)


def node_files_change_from(raw: dict) -> NodeFilesChange:
    sshd = raw.get("sshd") or {}
    return NodeFilesChange(changed=bool(raw.get("changed")), paths=tuple(str(p) for p in raw.get("paths") or ()),
                           sshd_reloaded=str(sshd.get("reloaded") or ""), include_added=bool(sshd.get("include_added")),
                           warnings=tuple(str(w) for w in raw.get("warnings") or ()), raw=raw)


def copy_status_from(raw: dict) -> CopyStatus:
    lines = raw.get("log_tail") or raw.get("log") or ""
    gpus = raw.get("gpus")
    started = raw.get("started_at")
    return CopyStatus(copy=str(raw.get("copy") or ""), running=bool(raw.get("running")), healthy=bool(raw.get("healthy")),
                      pid=raw.get("pid"), port=raw.get("port"),
                      log_tail="\n".join(lines) if isinstance(lines, list) else str(lines),
                      cluster=str(raw.get("cluster") or ""), address=str(raw.get("address") or ""),
                      started_at=float(started) if isinstance(started, (int, float)) and not isinstance(started, bool) else None,
                      argv=tuple(str(a) for a in raw.get("argv") or () if isinstance(a, str)),
                      env_names=tuple(str(n) for n in raw.get("env_names") or () if isinstance(n, str)),
                      gpus=tuple(int(i) for i in gpus if isinstance(i, int) and not isinstance(i, bool))
                      if isinstance(gpus, list) else None)


def placed_model_from(raw: dict) -> PlacedModel:
    return PlacedModel(repo=str(raw.get("repo", "")), revision=str(raw.get("revision", "")), path=str(raw.get("path", "")),
                       bytes=int(raw.get("bytes") or 0), files=int(raw.get("files") or 0),
                       bytes_downloaded=int(raw.get("bytes_downloaded") or 0))


def ray_status_from(raw: dict) -> RayStatus:
    nodes = tuple(
        RayNode(address=str(n.get("address", "")), alive=bool(n.get("alive")), gpus=int(n.get("gpus") or 0),
                node_id=str(n.get("node_id", ""))[:64])
        for n in raw.get("nodes") or []
    )
    return RayStatus(nodes=nodes, alive_nodes=raw.get("alive_nodes"), gpus=raw.get("gpus"), raw=raw)


def runtime_status_from(raw: dict) -> RuntimeStatus:
    ray = raw.get("ray") or {}
    return RuntimeStatus(state=str(raw.get("state", "")), digest=str(raw.get("digest") or ""),
                         ray_running=bool(ray.get("running")), gcs_address=str(ray.get("gcs_address") or ""), raw=raw)


def heartbeat_started_from(raw: dict) -> HeartbeatStarted:
    return HeartbeatStarted(pid=raw.get("pid"), restarted=bool(raw.get("restarted")))


def heartbeat_status_from(raw: dict) -> HeartbeatStatus:
    return HeartbeatStatus(running=bool(raw.get("running")), configured=bool(raw.get("configured")),
                           pid=raw.get("pid"), version=str(raw.get("version") or ""))


def model_list_from(raw: dict) -> ModelList:
    return ModelList(models=tuple(placed_model_from(m) for m in raw.get("models") or []),
                     free_bytes=int(raw.get("free_bytes") or 0))


def hub_check_from(raw: dict) -> HubCheck:
    return HubCheck(ok=bool(raw.get("ok")), status=int(raw.get("status") or 0), seconds=float(raw.get("seconds") or 0.0))


def allreduce_result_from(raw: dict) -> AllReduceResult:
    return AllReduceResult(exit_status=int(raw.get("exit_status", -1)), timed_out=bool(raw.get("timed_out")),
                           stderr_tail=tuple(str(line) for line in raw.get("stderr_tail") or ()))


# -- the cluster's firewall (``firewall write|remove|status``, agent 0.10) --------------------------


@dataclass(frozen=True)
class FirewallState:
    """The cluster's nftables table on a machine, as ``firewall write``, ``remove`` or ``status`` left it."""

    table: str  # "inet fadenstack_<cluster>"
    present: bool  # the table is there now
    replaced: tuple[str, ...] = ()  # other clusters' tables a write took away
    ruleset: str = field(default="", repr=False)  # status: ``nft list table``'s text
    raw: dict = field(default_factory=dict, repr=False)


def firewall_state_from(raw: dict, *, present: bool | None = None) -> FirewallState:
    """``present`` given by the caller for write (True) and remove (False); status says it itself."""
    return FirewallState(table=str(raw.get("table") or ""),
                         present=bool(raw.get("present")) if present is None else present,
                         replaced=tuple(str(t) for t in raw.get("replaced") or ()),
                         ruleset=str(raw.get("ruleset") or ""), raw=raw)
