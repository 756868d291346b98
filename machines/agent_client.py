"""The server's one client of the agent on each machine.

This is the only place that builds an agent command line: every command is a
typed method, every result a value the callers read by attribute (those values
and their parsers are ``machines/agent_results.py``). The agent answers in JSON
lines (``agent/fadenstack_agent/protocol.py``); ``machines.remote`` carries them
over SSH.

    with Agent.open(machine) as agent:
        status = agent.runtime_status()

Unit tests replace ``Agent.open`` with a fake that answers from a script.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from fabric import Connection

from console.choices import ErrorKind
from machines import remote
from machines.agent_results import (
    AllReduceResult, CopyStatus, HeartbeatStarted, HeartbeatStatus, HubCheck, ImagesRemoved, ModelList, NodeFilesChange,
    PlacedModel, RayStatus, RuntimeStatus, SharedChange, SharedCleared, SharedStatus, allreduce_result_from, copy_status_from,
    heartbeat_started_from, heartbeat_status_from, hub_check_from, images_removed_from, model_list_from,
    node_files_change_from, placed_model_from, ray_status_from, runtime_status_from, shared_change_from,
    shared_cleared_from, shared_status_from,
)
from machines.agent_results import FirewallState, firewall_state_from
from machines.models import Machine
from machines.services import machine_target

AgentError = remote.RemoteError  # what every method raises: ``message`` in words, ``kind`` one of ErrorKind

Progress = Callable[[dict], None]
Abort = Callable[[], str | None]


@dataclass(frozen=True)
class FileSource:
    """Where a machine fetches a file from: the server (with a download token) or another machine."""

    url: str
    token: str = ""
    pin: str = ""  # with an https:// url: the SHA-256 of the certificate to accept (the console's, agent 0.10.0)


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


def _driver(driver: str) -> list[str]:
    return ["--driver", driver] if driver else []


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
            raise AgentError(f"{machine.name} has no agent yet: refresh its facts.", kind=ErrorKind.NOT_RETRYABLE)
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

    def agent_console_url(self) -> str:
        """The agents' TLS listener's URL as this machine sees it (0.10.0 agents, with the pin)."""
        return remote.agent_console_url(self.conn)

    # -- facts and the heartbeat (enrolment) ---------------------------------------------------

    def facts(self) -> dict:
        return self._call("facts")["facts"]

    def heartbeat_start(self, *, url: str, interval: int, token: str, pin: str = "") -> HeartbeatStarted:
        """Start the heartbeat daemon; the token goes on stdin, never on a command line. A daemon of
        another agent version or configuration is stopped (that process alone) and started again. With
        ``pin`` (agent 0.10.0, an https:// url) the beats go only to a console showing that certificate."""
        return heartbeat_started_from(self._call("heartbeat", "start", "--url", url, "--interval", str(interval),
                                                 *(["--pin", pin] if pin else []), stdin=token.encode() + b"\n"))

    def heartbeat_status(self) -> HeartbeatStatus:
        return heartbeat_status_from(self._call("heartbeat", "status", timeout=30))

    def version(self) -> str:
        """The version of the agent this client runs (its ``version`` command)."""
        return str(self._call("version", timeout=30).get("version") or "")

    # -- files: fetched with resume, served to the next machine --------------------------------

    def file_fetch(self, spec: FileSpec, source: FileSource, *, timeout: float, on_progress: Progress | None = None,
                   abort: Abort | None = None) -> int:
        """Fetch a file into the machine's store, chunk by verified chunk, resuming what an earlier try
        left; the bytes that crossed the network (resends included)."""
        body = {"digest": spec.digest, "size": spec.size, "chunk_size": spec.chunk_size, "chunk_hashes": spec.chunk_hashes,
                "source": {"url": source.url, **({"token": source.token} if source.token else {}),
                           **({"pin": source.pin} if source.pin else {})}}
        result = self._call("blob", "fetch", stdin=json.dumps(body).encode(), timeout=timeout, on_progress=on_progress, abort=abort)
        return int(result.get("bytes_fetched", 0))

    def serve_start(self, *, bind: str, port: int, token: str | None = None) -> None:
        """Serve the files this machine holds to the others, on the cluster's network; with ``token`` (agent
        0.10.0), only to a fetch that sends it (given on stdin, never on the command line)."""
        if token:
            self._call("blob", "serve", "start", "--bind", bind, "--port", str(port), "--token-stdin",
                       stdin=json.dumps({"token": token}).encode(), timeout=30)
        else:
            self._call("blob", "serve", "start", "--bind", bind, "--port", str(port), timeout=30)

    def serve_stop(self) -> None:
        self._call("blob", "serve", "stop", timeout=60)

    # -- models: placed from blobs, or downloaded from the hub by the machine itself ---------------

    def model_place(self, spec: ModelSpec, *, timeout: float = 300) -> PlacedModel:
        """Lay out a model whose files are blobs on the machine (``file_fetch``) as the tree an engine
        reads; refused (not_retryable) while a file is missing. Placing it again is harmless."""
        return placed_model_from(self._call("model", "place", stdin=json.dumps(spec.as_json()).encode(), timeout=timeout))

    def model_list(self) -> ModelList:
        return model_list_from(self._call("model", "list", timeout=60))

    def model_remove(self, *, repo: str, revision: str) -> int:
        """Remove a placed model and the files no other model on the machine uses; the bytes freed (0 when
        it was not there)."""
        return int(self._call("model", "remove", "--repo", repo, "--revision", revision, timeout=300).get("freed") or 0)

    def model_download(self, spec: ModelSpec, *, endpoint: str, token: str = "", timeout: float,
                       on_progress: Progress | None = None, abort: Abort | None = None) -> PlacedModel:
        """Have the machine download the model's missing files from the hub at ``endpoint`` (resuming what an
        earlier try left), then place it. The token goes inside the stdin JSON, never on a command line."""
        body = {**spec.as_json(), "endpoint": endpoint, **({"token": token} if token else {})}
        return placed_model_from(self._call("model", "download", stdin=json.dumps(body).encode(), timeout=timeout,
                                  on_progress=on_progress, abort=abort))

    def hub_check(self, url: str, *, timeout: float = 5) -> HubCheck:
        """Whether the machine itself reaches the hub at ``url`` (raises unreachable, in words, when not)."""
        return hub_check_from(self._call("hub", "check", "--url", url, "--timeout", f"{timeout:g}", timeout=timeout + 30))

    # -- copies of models: the engine inside the runtime container, on the GPUs placement gave it ----

    def copy_start(self, *, copy: str, cluster: str, env: dict[str, str], address: str, argv: list[str] | None = None,
                   port: int | None = None, ray: dict | None = None) -> CopyStatus:
        """Start a copy's engine (detached: it outlives this connection and the console's processes), or with
        ``ray`` (``{"head": None | "addr:port", "gpus": N}``) a node of a spanning copy's own Ray, whose
        ``port`` in the answer is its head's GCS port. The whole spec goes on stdin; starting a copy that
        already runs with the same spec is harmless."""
        body = {"copy": copy, "cluster": cluster, "env": env, "address": address}
        body |= {"ray": ray} if ray is not None else {"argv": argv, "port": port}
        return copy_status_from(self._call("copy", "start", stdin=json.dumps(body).encode(), timeout=120))

    def copy_stop(self, copy: str, *, timeout: int = 30) -> None:
        """Stop a copy's engine (SIGTERM, then SIGKILL); stopping one that is not running succeeds."""
        self._call("copy", "stop", "--copy", copy, "--timeout", str(timeout), timeout=timeout + 60)

    def copy_logs(self, copy: str, *, lines: int = 50) -> list[str]:
        """The last lines of a copy's engine log on this machine."""
        return list(self._call("copy", "logs", "--copy", copy, "--lines", str(lines), timeout=60).get("lines") or [])

    def copy_list(self) -> list[CopyStatus]:
        """Every copy the machine runs or ran, with whether its engine answers its health endpoint."""
        return [copy_status_from(raw) for raw in self._call("copy", "list", timeout=60).get("copies") or []]

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
        return runtime_status_from(self._call("runtime", "status", timeout=30))

    # -- Ray ------------------------------------------------------------------------------------

    def ray_start_head(self, *, address: str, port: int, gpus: int) -> RayStatus:
        """Start Ray's head; Ray's node list as it was once the head read alive."""
        return ray_status_from(self._call("ray", "start-head", "--address", address, "--port", str(port), "--num-gpus", str(gpus),
                                      timeout=180))

    def ray_join(self, *, head: str, address: str, gpus: int, abort: Abort | None = None) -> RayStatus:
        """Join the head's cluster; Ray's node list as it was once this machine read alive."""
        return ray_status_from(self._call("ray", "join", "--head", head, "--address", address, "--num-gpus", str(gpus), timeout=180,
                                      abort=abort))

    def ray_status(self, *, head: str, timeout: float = 60) -> RayStatus:
        return ray_status_from(self._call("ray", "status", "--head", head, timeout=timeout))

    def ray_reach(self, *, head: str) -> None:
        """Whether this machine reaches the head's Ray port (raises when not)."""
        self._call("ray", "reach", "--head", head, timeout=30)

    def ray_stop(self, *, abort: Abort | None = None) -> None:
        self._call("ray", "stop", timeout=60, abort=abort)

    def ray_drain(self, *, head: str, node_id: str, reason: str) -> tuple[bool, str]:
        """Ray's drain of one node, asked on the head (agent 0.11.0): (accepted, Ray's words when not)."""
        answer = self._call("ray", "drain", "--head", head, "--node-id", node_id, "--reason", reason, timeout=90)
        return bool(answer.get("accepted")), str(answer.get("refusal") or "")

    # -- a cluster's files on its machines: hostfile, settings, hosts, node-to-node SSH, sshd's trust ----

    def node_files_write(self, spec: Mapping) -> NodeFilesChange:
        """Put a member's cluster files in place (``clusters.node_files.node_files_spec`` builds the spec).
        The spec goes on stdin, never on a command line: it holds the cluster's private node key. sshd
        refusing the change is not_retryable with sshd's words, and the machine keeps its previous files."""
        return node_files_change_from(self._call("node", "files", "write", stdin=json.dumps(spec).encode(), timeout=120))

    def node_files_remove(self) -> NodeFilesChange:
        """Take a machine's cluster files away again (it left the cluster, or the cluster is deleted), every
        file it shares with the machine byte for byte as it was; harmless when there are none."""
        return node_files_change_from(self._call("node", "files", "remove", timeout=120))

    # -- /shared: on the head, mounted on every other node over the cluster's network ---------------

    def shared_status(self) -> SharedStatus:
        """What /shared is on the machine, and whether it can export it with NFS, mount NFS, or mount sshfs."""
        return shared_status_from(self._call("shared", "status", timeout=30))

    def shared_export(self, *, method: str, members: Sequence[str]) -> SharedChange:
        """Make the machine the head of /shared (1777, the hostfile copied in); with ``nfs`` exported to the
        other members' addresses ``members`` only, one line each, root_squash (agent 0.10.0)."""
        flags = ["--members", ",".join(members)] if method == "nfs" else []
        return shared_change_from(self._call("shared", "export", "--method", method, *flags, timeout=120))

    def shared_mount(self, *, head: str, method: str) -> SharedChange:
        """Mount the head's /shared on /shared (``head``: its address on the cluster's network); a live mount of
        the same source changes nothing, a dead one is mounted again. A head that does not answer is unreachable."""
        return shared_change_from(self._call("shared", "mount", "--head", head, "--method", method, timeout=120))

    def image_remove(self) -> ImagesRemoved:
        """Free the runtime images in the machine's store but the one its started runtime runs (agent 0.9)."""
        return images_removed_from(self._call("image", "remove", timeout=300))

    def shared_clear(self) -> SharedCleared:
        """Empty the /shared a deleted cluster left on its former head (agent 0.9)."""
        return shared_cleared_from(self._call("shared", "clear", timeout=300))

    def shared_unmount(self) -> SharedChange:
        """Take /shared away as the agent made it: a node's mount goes, the head's export goes and its files stay."""
        return shared_change_from(self._call("shared", "unmount", timeout=120))

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

        return allreduce_result_from(self._call("allreduce", "run", stdin=json.dumps(spec).encode(), timeout=timeout,
                                                on_progress=line_of, abort=abort))

    # -- the network test -------------------------------------------------------------------------

    def probe_serve(self, *, bind: str, port: int, seconds: int) -> None:
        self._call("probe", "serve", "--bind", bind, "--port", str(port), "--seconds", str(seconds), timeout=seconds + 30)

    def probe_send(self, *, to: str, port: int, seconds: int) -> float:
        """Send to a machine's probe server for ``seconds``; the measured Mbit/s."""
        result = self._call("probe", "send", "--to", to, "--port", str(port), "--seconds", str(seconds), timeout=seconds + 30)
        return float(result["mbps"])

    # -- the cluster's secrets on the machine: Ray's token (agent 0.10) ---------------------------

    def cluster_secrets_write(self, *, cluster: str, ray_token: str) -> None:
        """Put the cluster's secrets in its directory on the machine (0700, files 0600); the token goes on
        stdin, never on a command line, and the answer names files only."""
        self._call("cluster", "secrets", "write", "--cluster", cluster,
                   stdin=json.dumps({"ray_token": ray_token}).encode(), timeout=60)

    def cluster_secrets_remove(self, *, cluster: str) -> bool:
        """Take the cluster's secrets directory away from the machine; False when there was none."""
        return bool(self._call("cluster", "secrets", "remove", "--cluster", cluster, timeout=60).get("removed"))

    # -- the cluster's firewall: its own nftables table on each member (agent 0.10) ---------------------

    def ssh_client_address(self) -> str:
        """The address this SSH session comes from as the machine sees it: where the console's connections
        come from (the firewall lets it in to the copies and the file server). Empty when sshd does not say."""
        words = remote.run(self.conn, ["printenv", "SSH_CONNECTION"], timeout=30).stdout.split()
        return words[0] if words else ""

    def firewall_write(self, *, cluster: str, spec: Mapping) -> FirewallState:
        """Replace the cluster's nftables table on the machine whole (``clusters.firewall.firewall_spec``
        builds the spec, which goes on stdin); a bad part is bad_input, no nft not_retryable."""
        return firewall_state_from(self._call("firewall", "write", "--cluster", cluster,
                                              stdin=json.dumps(dict(spec)).encode(), timeout=60), present=True)

    def firewall_remove(self, *, cluster: str) -> FirewallState:
        """Delete the cluster's table (the machine left it, or it was deleted); harmless when there is none."""
        return firewall_state_from(self._call("firewall", "remove", "--cluster", cluster, timeout=60), present=False)

    def firewall_status(self, *, cluster: str) -> FirewallState:
        """Whether the cluster's table is on the machine, with its rules as nft lists them."""
        return firewall_state_from(self._call("firewall", "status", "--cluster", cluster, timeout=60))

    # -- node logins taken back (agent 0.10.0) ------------------------------------------------------

    def node_revocations_write(self, *, cluster: str, krl: bytes) -> bool:
        """Replace the machine's key revocation list for ``cluster``'s node logins (the KRL's bytes on stdin);
        whether it changed. Refused (not_retryable) when the machine's node settings are not that cluster's."""
        return bool(self._call("node", "revocations", "write", "--cluster", cluster, stdin=krl, timeout=60).get("changed"))

    # -- TLS: the cluster's keys (made on the machine) and certificates (console/pki.py signs them) ----

    def tls_request(self, *, cluster: str, roles: list[str], address: str) -> dict[str, str]:
        """A new key on the machine for each role (it never leaves it) and its signing request: {role: PEM} (agent 0.10.0)."""
        result = self._call("tls", "request", "--cluster", cluster, "--role", ",".join(roles), "--address", address, timeout=60)
        return {str(role): str(pem) for role, pem in (result.get("requests") or {}).items()}

    def tls_install(self, *, cluster: str, ca: str, certificates: Mapping[str, str]) -> dict[str, str]:
        """Put the certificates beside their keys, with the authority's: {role: expiry, ISO 8601} (agent 0.10.0).
        Certificates are no secret, but they go on stdin all the same: they do not fit a command line."""
        body = json.dumps({"ca": ca, "certificates": dict(certificates)}).encode()
        result = self._call("tls", "install", "--cluster", cluster, stdin=body, timeout=60)
        return {str(role): str((entry or {}).get("not_after") or "") for role, entry in (result.get("installed") or {}).items()}

    def tls_status(self, *, cluster: str) -> dict:
        """What is installed for the cluster: {"ca", "certificates": {role: {"not_after", "serial"}}, "pending"} (agent 0.10.0)."""
        result = self._call("tls", "status", "--cluster", cluster, timeout=30)
        return {"ca": result.get("ca"), "certificates": dict(result.get("certificates") or {}),
                "pending": list(result.get("pending") or [])}
