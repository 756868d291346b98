"""A stand-in for the server's agent client (machines.agent_client.Agent), for unit tests.

``FakeAgents(answers)`` replaces ``Agent.open``: each machine's agent answers
from ``answers[machine name]``, a dict shaped like the agent's own results
(``runtime``: what ``runtime status`` returns, ``ray``: what ``ray status``
returns; ``ray_started``: the node list a ``ray start-head`` or ``ray join`` returns), or fails with
``error`` (the SSH session) or ``ray_error`` (Ray on the head). Every call is recorded as ``(machine name, method, kwargs)``.
Models placed or downloaded stay on their machine (``FakeAgents.models``) until removed;
``model_error`` / ``hub_error`` make those commands fail (``(kind, message)``).
Copies of models started on a machine run (``FakeAgents.copies``) until stopped; ``copy_error`` fails a
start, ``copy_exited`` ({copy id or "*": last lines}) makes a copy's engine read as exited.
A machine's host key is made up so that its fingerprint is the one tests.factories pins for its name (``host_key``
gives another line); node files written stay on their machine (``FakeAgents.node_files``: the spec) until removed;
``node_files_error`` (``(kind, message)``) fails a write or a remove, ``node_files_warnings`` are the machine's sentences.
/shared: ``shared_can`` / ``shared_cannot`` are what ``shared status`` says the machine can do (sshfs only by
default); an export or a mount stays on its machine (``FakeAgents.shared``: ``{"role", "method", "head"}``) until
unmounted, a mount of the same head and method again is ``already`` (changes nothing); ``shared_error``
(``(kind, message)``) fails an export, a mount or an unmount. ``image_remove`` / ``shared_clear`` are what those
commands answer (``image_remove_error`` / ``shared_clear_error``: ``(kind, message)`` fails them).
``allreduce_run`` replays a recorded all_reduce_perf output line by line (``allreduce``: ``{"fixture": a file of
tests/fixtures/nccl, default a3mega-h100-2x8.txt, or "lines": [...], "exit_status", "timed_out", "stderr_tail"}``),
asking ``abort`` before each line as the SSH session does (a reason ends it as unreachable);
``FakeAgents.on_allreduce_line(index)`` is called after each; ``allreduce_error`` (``(kind, message)``) refuses the run.
"""
from __future__ import annotations

import base64
from contextlib import contextmanager
from pathlib import Path

from console.choices import ErrorKind
from machines import agent_client, agent_results
from machines.agent_client import AgentError
from machines.agent_results import ImagesRemoved, SharedCleared, images_removed_from, shared_cleared_from

NCCL_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nccl"


def _visible_gpus(env: dict) -> tuple[int, ...] | None:
    """The GPUs a copy's environment shows it, as the agent's ``copy list`` reports them."""
    value = next((env[n] for n in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES") if n in env), None)
    return None if value is None else tuple(int(i) for i in str(value).split(",") if i.strip())


class FakeAgent:

    def __init__(self, fakes: FakeAgents, machine):
        self._fakes, self.machine = fakes, machine

    def _answer(self, method: str, **kwargs) -> dict:
        self._fakes.calls.append((self.machine.name, method, kwargs))
        return self._fakes.answers.get(self.machine.name, {})

    def runtime_status(self):
        return agent_results.runtime_status_from(self._answer("runtime_status").get("runtime") or {})

    def ray_status(self, *, head: str, timeout: float = 60):
        answer = self._answer("ray_status", head=head)
        if self._fakes.on_ray_status:
            self._fakes.on_ray_status()
        if "ray" not in answer:
            raise AgentError(answer.get("ray_error", "Ray is not running here."), kind=ErrorKind.RETRYABLE)
        return agent_results.ray_status_from(answer["ray"])

    def _ray_started(self, method: str, **kwargs):
        """Ray's node list as a start or a join returns it: ``ray_started`` in the machine's answers, else none."""
        answer = self._answer(method, **kwargs)
        return agent_results.ray_status_from(answer.get("ray_started") or {})

    def ray_start_head(self, **kwargs):
        return self._ray_started("ray_start_head", **kwargs)

    def ray_join(self, **kwargs):
        return self._ray_started("ray_join", **kwargs)

    def console_url(self) -> str:
        self._answer("console_url")
        return "http://198.18.0.1:8000"

    def agent_console_url(self) -> str:
        return "https://198.18.0.1:8443"

    def file_fetch(self, spec, source, **kwargs) -> int:
        """The whole file arrives: its size is what crossed the network."""
        self._answer("file_fetch", digest=spec.digest, url=source.url, token=source.token, timeout=kwargs.get("timeout"))
        if kwargs.get("on_progress"):
            kwargs["on_progress"]({"event": "progress", "bytes": spec.size // 2, "rate": 1.0})
        return spec.size

    def _models(self) -> dict:
        return self._fakes.models.setdefault(self.machine.name, {})

    def _fail(self, key: str) -> None:
        failure = self._fakes.answers.get(self.machine.name, {}).get(key)
        if failure:
            kind, message = failure
            raise AgentError(message, kind=kind)

    def _place(self, spec, method: str, **kwargs) -> agent_results.PlacedModel:
        self._answer(method, repo=spec.repo, revision=spec.revision, **kwargs)
        self._fail("model_error")
        placed = agent_results.PlacedModel(
            repo=spec.repo, revision=spec.revision, path=f"/var/lib/fadenstack/models/{spec.repo.replace('/', '--')}/{spec.revision}",
            bytes=sum(f.size for f in spec.files), files=len(spec.files),
            bytes_downloaded=sum(f.size for f in spec.files) if method == "model_download" else 0)
        self._models()[(spec.repo, spec.revision)] = placed
        return placed

    def model_place(self, spec, **kwargs) -> agent_results.PlacedModel:
        return self._place(spec, "model_place")

    def model_download(self, spec, *, endpoint: str, token: str = "", timeout: float, on_progress=None, abort=None):
        """The whole model arrives from the hub; one progress event per file."""
        for f in spec.files:
            if on_progress:
                on_progress({"event": "progress", "digest": f.digest, "file": f.path, "bytes": f.size, "total": f.size, "rate": 1})
        return self._place(spec, "model_download", endpoint=endpoint, token=token, timeout=timeout)

    def model_list(self) -> agent_results.ModelList:
        answer = self._answer("model_list")
        return agent_results.ModelList(models=tuple(self._models().values()), free_bytes=answer.get("free_bytes", 1 << 40))

    def model_remove(self, *, repo: str, revision: str) -> int:
        self._answer("model_remove", repo=repo, revision=revision)
        placed = self._models().pop((repo, revision), None)
        return placed.bytes if placed else 0

    def hub_check(self, url: str, *, timeout: float = 5) -> agent_results.HubCheck:
        self._answer("hub_check", url=url, timeout=timeout)
        self._fail("hub_error")
        return agent_results.HubCheck(ok=True, status=200, seconds=0.05)

    def _copies(self) -> dict:
        return self._fakes.copies.setdefault(self.machine.name, {})

    def copy_start(self, *, copy: str, cluster: str, env, address: str, argv=None, port: int | None = None,
                   ray: dict | None = None) -> agent_results.CopyStatus:
        """The engine starts (a new pid each time), or with ``ray`` a node of the copy's own Ray (a head
        answers its GCS port); ``copy_error`` fails the start."""
        self._answer("copy_start", copy=copy, cluster=cluster, argv=argv, env=env, port=port, address=address, ray=ray)
        self._fail("copy_error")
        self._fakes.answers.get(self.machine.name, {}).get("copy_exited", {}).pop(copy, None)  # a new engine
        self._fakes.answers.get(self.machine.name, {}).get("copy_silent", set()).discard(copy)
        self._fakes.pids += 1
        if ray is not None and ray.get("head") is None:
            port = 40000 + self._fakes.pids
        self._copies()[copy] = {"pid": self._fakes.pids, "port": port, "argv": argv, "env": env, "ray": ray,
                                "cluster": cluster, "address": address, "started_at": 1_700_000_000.0 + self._fakes.pids}
        return agent_results.CopyStatus(copy=copy, running=True, healthy=False, pid=self._fakes.pids, port=port, log_tail="")

    def copy_stop(self, copy: str, **kwargs) -> None:
        self._answer("copy_stop", copy=copy)
        self._copies().pop(copy, None)

    def copy_list(self) -> list[agent_results.CopyStatus]:
        """Each copy answers its health, unless ``copy_exited`` names it (then it exited with those words)
        or ``copy_silent`` does (it runs, but its health check goes unanswered)."""
        answer = self._answer("copy_list")
        exited = answer.get("copy_exited", {})  # {copy id or "*": its last lines}
        silent = answer.get("copy_silent", set())
        return [agent_results.CopyStatus(copy=key, running=not words, healthy=not words and key not in silent,
                                        pid=c["pid"], port=c["port"], log_tail=words, cluster=c.get("cluster") or "",
                                        address=c.get("address") or "", started_at=c.get("started_at"),
                                        argv=tuple(c.get("argv") or ()), env_names=tuple(sorted(c.get("env") or {})),
                                        gpus=_visible_gpus(c.get("env") or {}))
                for key, c in self._copies().items() for words in [exited.get(key) or exited.get("*") or ""]]

    def host_key(self) -> str:
        answer = self._answer("host_key")
        return answer.get("host_key") or f"ssh-ed25519 {base64.b64encode(self.machine.name.encode()).decode()}"

    def _node_files_change(self, *, changed: bool) -> agent_results.NodeFilesChange:
        warnings = tuple(self._fakes.answers.get(self.machine.name, {}).get("node_files_warnings", ()))
        return agent_results.NodeFilesChange(changed=changed, paths=("/etc/fadenstack/hostfile",) if changed else (),
                                            sshd_reloaded="", include_added=False, warnings=warnings, raw={})

    def node_files_write(self, spec) -> agent_results.NodeFilesChange:
        self._answer("node_files_write", spec=spec)
        self._fail("node_files_error")
        changed = self._fakes.node_files.get(self.machine.name) != spec
        self._fakes.node_files[self.machine.name] = spec
        return self._node_files_change(changed=changed)

    def node_files_remove(self) -> agent_results.NodeFilesChange:
        self._answer("node_files_remove")
        self._fail("node_files_error")
        return self._node_files_change(changed=self._fakes.node_files.pop(self.machine.name, None) is not None)

    def allreduce_run(self, spec, *, on_line, abort=None, timeout: float) -> agent_results.AllReduceResult:
        """The recorded output, line by line (the fixture's own ``# Source:`` line is not the program's)."""
        answer = self._answer("allreduce_run", spec=spec, timeout=timeout).get("allreduce") or {}
        self._fail("allreduce_error")
        lines = answer.get("lines")
        if lines is None:
            text = (NCCL_FIXTURES / answer.get("fixture", "a3mega-h100-2x8.txt")).read_text()
            lines = [line for line in text.splitlines() if not line.startswith("# Source:")]
        for index, line in enumerate(lines):
            if abort and (reason := abort()):
                raise AgentError(reason, kind=ErrorKind.UNREACHABLE)
            on_line(line)
            if self._fakes.on_allreduce_line:
                self._fakes.on_allreduce_line(index)
        return agent_results.AllReduceResult(exit_status=answer.get("exit_status", 0), timed_out=answer.get("timed_out", False),
                                            stderr_tail=tuple(answer.get("stderr_tail", ())))

    def shared_status(self) -> agent_results.SharedStatus:
        answer = self._answer("shared_status")
        can = {"nfs_export": False, "nfs_mount": False, "sshfs": True, **answer.get("shared_can", {})}
        held = self._fakes.shared.get(self.machine.name) or {}
        mounted = held.get("role") == "node"
        return agent_results.SharedStatus(
            mounted=mounted, method=held.get("method", "") if mounted else "", alive=True if mounted else None,
            source=f"root@{held['head']}:/shared" if mounted else "", role=held.get("role", ""), can=can,
            cannot={"nfs_export": "exportfs is not installed (apt-get install nfs-kernel-server)",
                    **answer.get("shared_cannot", {})}, raw={})

    def _shared_called(self, called: str, **kwargs) -> None:
        # Recorded as _answer records, by hand: these calls have a ``method`` of their own.
        self._fakes.calls.append((self.machine.name, called, kwargs))

    def _shared_change(self, *, changed: bool, method: str = "", kept: str = "") -> agent_results.SharedChange:
        return agent_results.SharedChange(changed=changed, method=method, remounted=False, kept=kept, warnings=(), raw={})

    def shared_export(self, *, method: str, members) -> agent_results.SharedChange:
        self._shared_called("shared_export", method=method, members=list(members))
        self._fail("shared_error")
        held = {"role": "head", "method": method}
        changed = self._fakes.shared.get(self.machine.name) != held
        self._fakes.shared[self.machine.name] = held
        return self._shared_change(changed=changed, method=method)

    def shared_mount(self, *, head: str, method: str) -> agent_results.SharedChange:
        self._shared_called("shared_mount", head=head, method=method)
        self._fail("shared_error")
        held = {"role": "node", "method": method, "head": head}
        changed = self._fakes.shared.get(self.machine.name) != held
        self._fakes.shared[self.machine.name] = held
        return self._shared_change(changed=changed, method=method)

    def shared_unmount(self) -> agent_results.SharedChange:
        self._answer("shared_unmount")
        self._fail("shared_error")
        held = self._fakes.shared.pop(self.machine.name, None) or {}
        return self._shared_change(changed=bool(held), method=held.get("method", ""),
                                   kept="/shared" if held.get("role") == "head" else "")

    def image_remove(self) -> ImagesRemoved:
        """What ``image remove`` freed: ``image_remove`` in the machine's answers, else nothing."""
        self._fail("image_remove_error")
        return images_removed_from(self._answer("image_remove").get("image_remove") or {})

    def shared_clear(self) -> SharedCleared:
        """What ``shared clear`` removed: ``shared_clear`` in the machine's answers, else nothing."""
        self._fail("shared_clear_error")
        return shared_cleared_from(self._answer("shared_clear").get("shared_clear") or {})

    # The cluster's firewall: a table written stays on its machine (``FakeAgents.firewalls``: cluster -> spec)
    # until removed; ``firewall_error`` (``(kind, message)``) fails a write or a remove; the console's address
    # as the machine sees its session is ``ssh_client`` (default 198.51.100.1).

    def ssh_client_address(self) -> str:
        return self._answer("ssh_client_address").get("ssh_client", "198.51.100.1")

    def firewall_write(self, *, cluster: str, spec) -> agent_results.FirewallState:
        self._answer("firewall_write", cluster=cluster, spec=spec)
        self._fail("firewall_error")
        self._fakes.firewalls.setdefault(self.machine.name, {})[cluster] = spec
        return agent_results.FirewallState(table=f"inet fadenstack_{cluster}", present=True)

    def firewall_remove(self, *, cluster: str) -> agent_results.FirewallState:
        self._answer("firewall_remove", cluster=cluster)
        self._fail("firewall_error")
        self._fakes.firewalls.get(self.machine.name, {}).pop(cluster, None)
        return agent_results.FirewallState(table=f"inet fadenstack_{cluster}", present=False)

    def firewall_status(self, *, cluster: str) -> agent_results.FirewallState:
        self._answer("firewall_status", cluster=cluster)
        return agent_results.FirewallState(table=f"inet fadenstack_{cluster}",
                                           present=cluster in self._fakes.firewalls.get(self.machine.name, {}))

    # -- TLS (pki): keys made "on the machine" (here, kept in FakeAgents.tls), requests signed by the console --------

    def tls_request(self, *, cluster: str, roles: list[str], address: str) -> dict[str, str]:
        """A real key and signing request per role; ``tls_error`` (``(kind, message)``) refuses."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self._answer("tls_request", cluster=cluster, roles=list(roles), address=address)
        self._fail("tls_error")
        held = self._fakes.tls.setdefault(self.machine.name, {}).setdefault(cluster, {"pending": {}, "installed": {}})
        requests = {}
        for role in roles:
            key = ec.generate_private_key(ec.SECP256R1())
            held["pending"][role] = key
            requests[role] = (x509.CertificateSigningRequestBuilder()
                              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)]))
                              .sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())
        return requests

    def tls_install(self, *, cluster: str, ca: str, certificates) -> dict[str, str]:
        from cryptography import x509

        self._answer("tls_install", cluster=cluster, roles=sorted(certificates))
        self._fail("tls_error")
        held = self._fakes.tls[self.machine.name][cluster]
        answer = {}
        for role, pem in certificates.items():
            cert = x509.load_pem_x509_certificate(pem.encode())
            key = held["pending"].pop(role)
            assert cert.public_key() == key.public_key(), "the certificate is not for the key made on the machine"
            held["installed"][role] = {"pem": pem, "ca": ca, "not_after": cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                       "serial": format(cert.serial_number, "x")}
            answer[role] = held["installed"][role]["not_after"]
        return answer

    def tls_status(self, *, cluster: str) -> dict:
        self._answer("tls_status", cluster=cluster)
        held = self._fakes.tls.get(self.machine.name, {}).get(cluster, {"pending": {}, "installed": {}})
        return {"ca": None, "certificates": {r: {"not_after": c["not_after"], "serial": c["serial"]} for r, c in held["installed"].items()},
                "pending": sorted(held["pending"])}

    def ray_drain(self, *, head: str, node_id: str, reason: str) -> tuple[bool, str]:
        """Ray takes the drain, unless ``ray_drain_refusal`` gives its words."""
        refusal = self._answer("ray_drain", head=head, node_id=node_id, reason=reason).get("ray_drain_refusal", "")
        return not refusal, refusal

    def __getattr__(self, method: str):
        # Commands that only act (start, stop, join, ...) succeed and are recorded.
        return lambda *args, **kwargs: self._answer(method, **kwargs) and None


class FakeAgents:

    def __init__(self, answers: dict[str, dict] | None = None):
        self.answers = answers if answers is not None else {}
        self.calls: list[tuple[str, str, dict]] = []
        self.models: dict[str, dict] = {}  # machine name -> {(repo, revision): PlacedModel}
        self.copies: dict[str, dict] = {}  # machine name -> {copy id: {"pid", "port", "argv", "env"}}
        self.node_files: dict[str, dict] = {}  # machine name -> the spec its node files were last written with
        self.shared: dict[str, dict] = {}  # machine name -> what /shared is there: {"role", "method", "head"}
        self.pids = 1000
        self.on_ray_status = None  # called whenever Ray's node list is asked for (to look at the database then)
        self.on_allreduce_line = None  # called after each line an NCCL test replays, with its index
        self.firewalls: dict[str, dict] = {}  # machine name -> {cluster: the spec its firewall was last written with}
        self.tls: dict[str, dict] = {}  # machine name -> cluster -> {"pending": {role: key}, "installed": {role: {...}}}

    @contextmanager
    def open(self, machine):
        error = self.answers.get(machine.name, {}).get("error")
        if error:
            raise AgentError(error, kind=ErrorKind.UNREACHABLE)
        yield FakeAgent(self, machine)

    def install(self, monkeypatch) -> FakeAgents:
        monkeypatch.setattr(agent_client.Agent, "open", self.open)
        return self


class FakeMachineShell:
    """A machine behind SSH, for the jobs that speak to it below the agent client (enrolment, Update agent).

    Replaces ``remote.connect``, ``remote.run``, ``remote.upload`` and ``remote.run_agent``, and answers
    what those jobs send: the preflight script (which Python, whether this build is there), the upload
    and its digest check, and the agent's commands (``version``, ``heartbeat status|start``), with the
    agent's version read from the file name, as each build is named. The heartbeat daemon is restarted
    when its version or token differs, as the agent's ``Daemon.start`` does. Every agent command is
    recorded as its argv after the agent's path (``["heartbeat", "start", ...]``).

    ``installed``: the build names already on the machine with their sha256; ``heartbeat``: the daemon
    (``version``, ``pid``, ``running``); ``stuck_heartbeat``: a daemon ``heartbeat start`` fails to
    replace; ``unreachable``: the words of a connection that fails.
    """

    HOME = "/opt/fadenstack"

    def __init__(self, *, installed: dict[str, str] | None = None, heartbeat: dict | None = None,
                 stuck_heartbeat: bool = False, unreachable: str = ""):
        self.files = {f"{self.HOME}/agent/{name}": digest for name, digest in (installed or {}).items()}
        self.heartbeat = {"running": False, "version": "", "pid": 4000, "token": None, **(heartbeat or {})}
        self.stuck_heartbeat = stuck_heartbeat
        self.unreachable = unreachable
        self.uploads: dict[str, str] = {}
        self.commands: list[list[str]] = []
        self.agent_paths: list[str] = []

    def install(self, monkeypatch) -> FakeMachineShell:
        from machines import remote

        monkeypatch.setattr(remote, "connect", self.connect)
        monkeypatch.setattr(remote, "run", self.run)
        monkeypatch.setattr(remote, "upload", self.upload)
        monkeypatch.setattr(remote, "run_agent", self.run_agent)
        return self

    @contextmanager
    def connect(self, target):
        from machines import remote

        if self.unreachable:
            raise remote.RemoteError(self.unreachable, kind="unreachable")
        yield type("FakeConnection", (), {"host": target.address})()

    def run(self, conn, argv, *, stdin=None, timeout=None):
        import json

        from machines import agent, remote

        if argv[1:3] == ["-c", agent._PREFLIGHT]:
            path = f"{self.HOME}/agent/{argv[3]}"
            found = {"python": "/usr/bin/python3", "version": "3.12.3", "supported": True, "path": path,
                     "sha256": self.files.get(path), "ssh_connection": "198.18.0.1 50022 198.18.0.11 22"}
            return remote.CommandResult(exit_status=0, stdout=json.dumps(found), stderr="")
        if argv[1:3] == ["-c", agent._VERIFY_AND_MOVE]:
            partial, final, expected = argv[3:6]
            got = self.uploads.pop(partial)
            if got != expected:
                return remote.CommandResult(exit_status=1, stdout="", stderr=f"sha256 {got}")
            self.files[final] = got
            return remote.CommandResult(exit_status=0, stdout="", stderr="")
        raise AssertionError(f"the fake machine does not know {argv}")

    def upload(self, conn, local, remote_path: str) -> None:
        import hashlib

        self.uploads[remote_path] = hashlib.sha256(local.read_bytes()).hexdigest()

    def run_agent(self, conn, argv, *, stdin=None, timeout=None, on_event=None, abort=None) -> dict:
        import re

        from machines import remote

        path, command = argv[1], list(argv[2:])
        if path not in self.files:
            raise remote.RemoteError(f"python3: can't open file {path!r}", kind="retryable")
        self.commands.append(command)
        self.agent_paths.append(path)
        version = re.fullmatch(r".*/fadenstack-agent-(.+)\.pyz", path).group(1)
        daemon = self.heartbeat
        if command == ["version"]:
            return {"event": "result", "version": version}
        if command == ["heartbeat", "status"]:
            return {"event": "result", "running": daemon["running"], "configured": daemon["token"] is not None,
                    "pid": daemon["pid"] if daemon["running"] else None,
                    "version": daemon["version"] if daemon["running"] else None}
        if command[:2] == ["heartbeat", "start"]:
            token = stdin.decode().strip()
            was_running = daemon["running"]
            if self.stuck_heartbeat:
                return {"event": "result", "running": True, "pid": daemon["pid"], "restarted": False}
            if not was_running or daemon["version"] != version or daemon["token"] != token:
                daemon.update(running=True, version=version, token=token, pid=daemon["pid"] + 1)
                return {"event": "result", "running": True, "pid": daemon["pid"], "restarted": was_running}
            return {"event": "result", "running": True, "pid": daemon["pid"], "restarted": False}
        return {"event": "result"}
