"""``facts``: what this machine is (accelerators, memory, arch, disk, network,
container runtime).  Runs the tools; the parsing lives in ``parsers``.

Every tool runs as an argv list (no shell) with a timeout.  A missing tool
means "none of that here"; a tool that exists but fails adds an entry to
``facts["warnings"]`` (``{"source": tool, "message": text}``) instead of
failing the command.
"""

import os
import socket
import subprocess

from . import get_version, gpuprocs, parsers
from .cli import arg, command
from .files import load_machine_config, store_dir

TIMEOUT = 10
NVIDIA_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,uuid,pci.bus_id",
                "--format=csv,noheader,nounits"]
ROCM_QUERY = ["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--showuniqueid",
              "--showbus", "--json"]
SYS_NET = "/sys/class/net"


class ToolRun:
    """Outcome of one tool run: ``rc`` is None when it timed out."""

    def __init__(self, argv, rc, stdout, stderr):
        self.argv, self.rc, self.stdout, self.stderr = argv, rc, stdout, stderr

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def describe_failure(self) -> str:
        tool = self.argv[0]
        if self.rc is None:
            return "%s did not answer within %d s" % (tool, TIMEOUT)
        text = (self.stderr or "").strip() or (self.stdout or "").strip() or "no output"
        return "%s exited with status %s: %s" % (tool, self.rc, text.splitlines()[0][:500])


def run_tool(argv, timeout=TIMEOUT):
    """Run ``argv``; None when the program is not installed (or not runnable)."""
    env = dict(os.environ)
    env["LC_ALL"] = "C"
    env.pop("LANGUAGE", None)
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=timeout, env=env)
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        return None
    except subprocess.TimeoutExpired as exc:
        return ToolRun(argv, None, _text(exc.stdout), _text(exc.stderr))
    return ToolRun(argv, proc.returncode, _text(proc.stdout), _text(proc.stderr))


def _text(data) -> str:
    if data is None:
        return ""
    if isinstance(data, str):
        return data
    return data.decode("utf-8", "replace")


def _read(path: str):
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


class Collector:
    """Gathers facts, collecting warnings as it goes."""

    def __init__(self, store=None, config=None, runner=run_tool):
        self.store_override = store
        self.config = load_machine_config() if config is None else config
        self.run = runner
        self.warnings = []
        self.docker_silence = None      # why an installed Docker's daemon did not answer

    def warn(self, source: str, message: str) -> None:
        self.warnings.append({"source": source, "message": message})

    def collect(self) -> dict:
        facts = {
            "agent_version": get_version(),
            "hostname": socket.gethostname(),
            "arch": self.arch(),
            "cpu_count": os.cpu_count(),
            "memory_mib": self.memory_mib(),
            "kernel": os.uname().release,
            "os": parsers.parse_os_release(_read("/etc/os-release") or ""),
            "store": self.store(),
            "accelerators": self.accelerators(),
            "gpu_processes": self.gpu_processes(),
            "interfaces": self.interfaces(),
            "container_runtimes": self.container_runtimes(),
        }
        facts["container_runtime"] = self.container_runtime(facts["container_runtimes"])
        facts["warnings"] = self.warnings
        return facts

    def arch(self):
        # `uname -m`, not platform.machine(): the lab plays other architectures
        # with a stub uname first in PATH.
        run = self.run(["uname", "-m"])
        if run is not None and run.ok and run.stdout.strip():
            return run.stdout.strip().splitlines()[0].strip()
        self.warn("uname", run.describe_failure() if run else "uname not found")
        return os.uname().machine

    def memory_mib(self):
        try:
            return parsers.parse_meminfo_total_mib(_read("/proc/meminfo") or "")
        except parsers.ToolOutputError as exc:
            self.warn("meminfo", str(exc))
            return None

    def store(self) -> dict:
        path = store_dir(self.store_override, self.config)
        out = {"path": path, "free_bytes": None, "total_bytes": None}
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
            st = os.statvfs(path)
        except OSError as exc:
            self.warn("store", "%s: %s" % (path, exc.strerror or exc))
            return out
        out["free_bytes"] = st.f_bavail * st.f_frsize
        out["total_bytes"] = st.f_blocks * st.f_frsize
        return out

    def accelerators(self) -> list:
        found = []
        for argv, parse in ((NVIDIA_QUERY, parsers.parse_nvidia_smi_csv),
                            (ROCM_QUERY, parsers.parse_rocm_smi_json)):
            run = self.run(argv)
            if run is None:
                continue                      # tool absent: no GPUs of that vendor
            if not run.ok:
                if argv[0] == "nvidia-smi" and run.rc is not None and \
                        "no devices were found" in (run.stdout + run.stderr).lower():
                    continue                  # nvidia-smi exits 6 with no GPUs
                self.warn(argv[0], run.describe_failure())
                continue
            try:
                found.extend(parse(run.stdout))
            except parsers.ToolOutputError as exc:
                self.warn(argv[0], str(exc))
        return found

    def gpu_processes(self):
        """The processes on this machine's NVIDIA GPUs (``gpuprocs``), or None without nvidia-smi."""
        processes, warning = gpuprocs.read(self.run, store_dir(self.store_override, self.config))
        if warning:
            self.warn("nvidia-smi", warning)
        return processes

    def interfaces(self) -> list:
        run = self.run(["ip", "-d", "-j", "addr", "show"])
        if run is not None and not run.ok:
            run = self.run(["ip", "-j", "addr", "show"])
        if run is None:
            self.warn("ip", "ip (iproute2) not found")
            return []
        if not run.ok:
            self.warn("ip", run.describe_failure())
            return []
        routes = []
        for argv in (["ip", "-j", "route", "show", "default"],
                     ["ip", "-j", "-6", "route", "show", "default"]):
            r = self.run(argv)
            if r is not None and r.ok:
                routes.append(r.stdout)
            elif r is not None and argv[2] != "-6":
                self.warn("ip", r.describe_failure())
        try:
            interfaces = parsers.build_interfaces(run.stdout, routes)
        except parsers.ToolOutputError as exc:
            self.warn("ip", str(exc))
            return []
        for iface in interfaces:
            if iface["kind"] not in ("loopback", "vpn"):
                iface["speed_mbps"] = self.speed(iface)
        return interfaces

    def speed(self, iface: dict):
        name = iface["name"]
        if "/" in name or name.startswith("."):
            return None
        speed = parsers.parse_sys_speed(_read(os.path.join(SYS_NET, name, "speed")))
        if speed is None and iface["kind"] == "physical" and iface["state"] == "up":
            run = self.run(["ethtool", name])
            if run is not None and run.ok:
                speed = parsers.parse_ethtool_speed(run.stdout)
        return speed

    def container_runtimes(self) -> list:
        """Every engine found: ``[{"name", "version", "answers"}]``; ``answers``
        is whether it can run containers now (Docker: its daemon answered;
        Podman needs no daemon)."""
        found = []
        docker = self.run(["docker", "version", "--format", "{{.Server.Version}}"])
        if docker is not None:
            version = parsers.parse_docker_version(docker.stdout) if docker.ok else None
            if version:
                found.append({"name": "docker", "version": version, "answers": True})
            else:
                client = self.run(["docker", "--version"])
                words = client.stdout if client is not None and client.ok else ""
                found.append({"name": "docker", "version": parsers.parse_cli_version(words),
                              "answers": False})
                self.docker_silence = docker.describe_failure() if not docker.ok else "no server version"
        podman = self.run(["podman", "--version"])
        if podman is not None and podman.ok:
            version = parsers.parse_cli_version(podman.stdout)
            if version:
                found.append({"name": "podman", "version": version, "answers": True})
        return found

    def container_runtime(self, engines: list):
        """The runtime this machine uses: the configured driver, else Docker if
        its daemon answers, else Podman (None: no runtime)."""
        driver = self.config.get("runtime_driver")
        if isinstance(driver, str) and driver:
            return {"name": driver, "version": get_version()}
        for engine in engines:
            if engine["answers"]:
                return {"name": engine["name"], "version": engine["version"]}
        if self.docker_silence:
            self.warn("docker", "docker is installed but its daemon did not answer: " + self.docker_silence)
        return None


def collect_facts(store=None) -> dict:
    """Collect this machine's facts (see the module docstring)."""
    return Collector(store=store).collect()


@command("facts", args=[arg("--store", metavar="PATH", help="store directory to measure")])
def cmd_facts(args, out) -> int:
    """``facts [--store PATH]``: what this machine is.

    Result: ``{"facts": {"agent_version", "hostname", "arch", "cpu_count",
    "memory_mib", "kernel", "os", "store": {"path", "free_bytes",
    "total_bytes"}, "accelerators": [...], "gpu_processes": [...] | null,
    "interfaces": [...],
    "container_runtime": {"name", "version"} | null, "container_runtimes":
    [{"name": "docker"|"podman", "version", "answers": bool}], "warnings":
    [...]}}``.

    ``container_runtime`` is the runtime the machine uses: the driver the
    machine config names (the lab's ``process``, with the agent's version),
    else Docker if its daemon answers, else Podman.  ``container_runtimes``
    lists every engine found, whichever is used: an installed Docker whose
    daemon does not answer is listed with ``answers: false`` (and a warning).
    ``gpu_processes`` (agent 0.9): ``[{"gpu_uuid", "pid", "used_memory_mib",
    "console"}]``, the processes using a GPU and whether they are the copies'
    the agent started (``gpuprocs``); null without nvidia-smi.
    """
    return out.result(facts=collect_facts(store=args.store))
