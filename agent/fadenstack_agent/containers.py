"""Docker's and Podman's command lines and output, for the ``docker`` and
``podman`` runtime drivers (pure: nothing here starts a process).

The two drivers of ``runtime`` build every engine command here, as argument
lists (never shell strings: a cluster name or a path must not become shell
syntax), and read the engine's answers here, so that both engines' dialects
live in one place and are held by unit tests.  Their answers are read in
``engineoutput``; the drivers (running these commands) are in ``engines``.

The runtime container (``Engine.run_argv``):

- detached, named ``fadenstack-<cluster>``, labelled with the cluster and the
  machine, so that what another cluster left can be found (``ps_argv``) and
  removed;
- ``--restart no``: the console repairs a cluster; an engine restarting Ray
  behind its back would hide the failure from the checks;
- no ``--rm``: a container that failed to start keeps its log, and the console
  shows the machine's own words (``logs_argv``);
- host network (Ray and the engine bind the machine's addresses) and host IPC.
  Shared memory: with ``--ipc host`` the container uses the machine's
  ``/dev/shm``, and Podman refuses ``--shm-size`` beside it (seen in the lab),
  so a size is given only with ``ipc="private"`` (Ray's advice is about 30 %
  of memory: ``ray_shm_size_mib``);
- least privilege: ``--cap-drop all`` and back only ``CAPABILITIES`` (see
  docs/security.md for each and why), ``--security-opt no-new-privileges``;
- the machine's store at ``/var/lib/fadenstack``, read-only, but for the
  subdirectories Ray and the engines write (``WRITABLE``: Ray's temp dir, the
  copies' Ray temp dirs, the copies' logs and pid files, the NCCL test's
  directory), each mounted read-write over it; the agent's own records
  (``runtime/``, the copies' records) stay where the container cannot write;
- the cluster's secrets directory (``clustersecrets``) read-only at
  ``/etc/fadenstack/cluster`` (a directory: the files written into it later,
  like Ray's token, show there at once);
- environment variables as ``-e NAME`` only: the engine takes each value from
  its own environment (``engine_environ``), so secrets never appear in ``ps``;
- GPUs the way each engine and vendor expects (``gpu_args``).

Per-engine settings come from the machine config's section named after the
engine (``/etc/fadenstack/agent.json``), for hosts that need them, like the
lab's::

    "podman": {"global_args": ["--runtime", "runc", "--cgroup-manager", "cgroupfs"],
               "ulimits": {"nofile": 65536, "nproc": [4096, 4096]}}

Global options go before the subcommand of every command; ulimits (at or below
the host's hard limits: raising them is not permitted there) go on ``run``.
"""

import os
import re

from .protocol import BAD_INPUT, NOT_RETRYABLE, AgentError

ENGINES = ("docker", "podman")
NVIDIA, AMD = "nvidia", "amd"
GPU_VENDORS = (NVIDIA, AMD)
NAME_PREFIX = "fadenstack-"
CLUSTER_LABEL = "fadenstack.cluster"
MACHINE_LABEL = "fadenstack.machine"
STORE_IN_CONTAINER = "/var/lib/fadenstack"
SECRETS_IN_CONTAINER = "/etc/fadenstack/cluster"   # the cluster's secrets directory, read-only
RAY_TOKEN_FILE = "ray-token"
# The store's subdirectories the container writes (each mounted read-write over the read-only store):
# Ray's temp dir (sockets, session logs), the copies' own Ray temp dirs (copyray), the copies' logs and
# pid files (copyproc.OUT), the NCCL test's run directory (allreduce.RUN_DIR).
WRITABLE = ("ray", "cr", "copies/out", "allreduce")
# Every capability is dropped and none comes back: Ray, the engine and the NCCL test over TCP need none
# (measured in the lab: docs/security.md).  NCCL over InfiniBand/RoCE pins its buffers: a machine with it
# raises the locked-memory limit in its config ("ulimits": {"memlock": -1}) rather than getting IPC_LOCK.
CAPABILITIES = ()
RAY_SHM_SHARE = 0.30
STOP_TIMEOUT_MAX = 3600
LOG_LINES_MAX = 10000

CLUSTER_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
MACHINE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The resource names both engines accept in --ulimit.
ULIMIT_NAMES = ("core", "cpu", "data", "fsize", "locks", "memlock", "msgqueue", "nice", "nofile",
                "nproc", "rss", "rtprio", "rttime", "sigpending", "stack")


# ------------------------------------------------------------------ names


def container_name(cluster: str) -> str:
    """``fadenstack-<cluster>``: one runtime container per cluster and machine."""
    if not isinstance(cluster, str) or not CLUSTER_RE.match(cluster):
        raise AgentError(BAD_INPUT, "The cluster name must be 1 to 63 lowercase letters, digits and "
                                    "dashes, not starting or ending with a dash, got %r" % (cluster,))
    return NAME_PREFIX + cluster


def check_machine(machine: str) -> str:
    if not isinstance(machine, str) or not MACHINE_RE.match(machine):
        raise AgentError(BAD_INPUT, "The machine name must be letters, digits, dots, dashes and "
                                    "underscores (at most 253), got %r" % (machine,))
    return machine


def check_env_names(names) -> list:
    """Variable names only: a ``NAME=VALUE`` here would put the value in ``ps``."""
    checked = []
    for name in names:
        if not isinstance(name, str) or not ENV_NAME_RE.match(name):
            raise AgentError(BAD_INPUT, "An environment variable name must be letters, digits and "
                                        "underscores (values go in the engine's environment), got %r"
                             % (name if not isinstance(name, str) or "=" not in name
                                else name.split("=", 1)[0] + "=..."))
        checked.append(name)
    return checked


def engine_environ(values: dict, base=None) -> dict:
    """The engine's environment: ``base`` (default ours) plus ``values``, so
    that ``-e NAME`` passes each value to the container without showing it."""
    check_env_names(list(values))
    env = dict(os.environ if base is None else base)
    for name, value in values.items():
        if not isinstance(value, str) or "\0" in value:
            raise AgentError(BAD_INPUT, "The value of %s must be text without NUL" % name)
        env[name] = value
    return env


def ray_shm_size_mib(memory_bytes: int) -> int:
    """Ray's advice for a container's shared memory: about 30 % of memory."""
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
        raise AgentError(BAD_INPUT, "memory must be a positive number of bytes, got %r" % (memory_bytes,))
    return max(64, int(memory_bytes * RAY_SHM_SHARE) // (1024 * 1024))


# Variables whose values are no secret and may be given as NAME=VALUE on ``exec``'s command line.
SETTINGS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


def ray_auth_env(token_path: str = SECRETS_IN_CONTAINER + "/" + RAY_TOKEN_FILE) -> dict:
    """Ray's token authentication, by Ray's own variables (Ray 2.52 and later): Ray reads the token
    from the file; the token itself is never on a command line or in an environment."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}


def _whole(value, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise AgentError(BAD_INPUT, "%s must be a whole number from %d to %d, got %r"
                         % (what, low, high, value))
    return value


# ------------------------------------------------------------------ settings


def check_global_args(args, where: str) -> list:
    """Options only (``--runtime runc``, ``--runtime=runc``): a bare word that
    follows no option would be read as the subcommand."""
    if not isinstance(args, list):
        raise AgentError(NOT_RETRYABLE, "%s must be a list of options, got %r" % (where, args))
    expects_value = False
    for token in args:
        if not isinstance(token, str) or not token or "\0" in token or "\n" in token:
            raise AgentError(NOT_RETRYABLE, "%s holds %r, which is not an option" % (where, token))
        if token.startswith("-"):
            expects_value = token.startswith("--") and "=" not in token
        elif expects_value:
            expects_value = False
        else:
            raise AgentError(NOT_RETRYABLE, "%s holds %r, which follows no option: only options "
                                            "may come before the subcommand" % (where, token))
    return list(args)


def check_ulimits(ulimits, where: str) -> list:
    """``{"nofile": N | [soft, hard]}`` -> ``["--ulimit", "nofile=S:H", ...]``
    (-1 is unlimited; soft at most hard)."""
    if not isinstance(ulimits, dict):
        raise AgentError(NOT_RETRYABLE, "%s must be an object of limits, got %r" % (where, ulimits))
    argv = []
    for name in sorted(ulimits):
        value = ulimits[name]
        if name not in ULIMIT_NAMES:
            raise AgentError(NOT_RETRYABLE, "%s names an unknown limit %r (known: %s)"
                             % (where, name, ", ".join(ULIMIT_NAMES)))
        pair = value if isinstance(value, list) else [value, value]
        if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < -1 for v in pair):
            raise AgentError(NOT_RETRYABLE, "%s.%s must be a whole number or [soft, hard] (-1 for "
                                            "unlimited), got %r" % (where, name, value))
        soft, hard = pair
        if hard != -1 and (soft == -1 or soft > hard):
            raise AgentError(NOT_RETRYABLE, "%s.%s: the soft limit %s exceeds the hard limit %s"
                             % (where, name, soft, hard))
        argv += ["--ulimit", "%s=%d:%d" % (name, soft, hard)]
    return argv


# ------------------------------------------------------------------ commands


class Engine:
    """One container engine's command lines (``docker`` or ``podman``)."""

    def __init__(self, name: str, global_args=(), ulimits=None):
        if name not in ENGINES:
            raise AgentError(NOT_RETRYABLE, "Unknown container engine %r (known: %s)"
                             % (name, ", ".join(ENGINES)))
        where = "the machine config's \"%s\"" % name
        self.name = name
        self.global_args = check_global_args(list(global_args), where + ".global_args")
        self.ulimit_args = check_ulimits(ulimits or {}, where + ".ulimits")

    @classmethod
    def from_config(cls, name: str, config: dict) -> "Engine":
        """The engine with its settings from the machine config's section of its name."""
        section = config.get(name)
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise AgentError(NOT_RETRYABLE, "The machine config's \"%s\" must be an object, got %r"
                             % (name, section))
        return cls(name, section.get("global_args") or [], section.get("ulimits") or {})

    def argv(self, *args) -> list:
        return [self.name] + self.global_args + list(args)

    def load_argv(self, archive: str) -> list:
        """Load a verified image archive (docker-archive), read by ``parse_loaded``."""
        if not isinstance(archive, str) or not os.path.isabs(archive):
            raise AgentError(BAD_INPUT, "The image archive must be an absolute path, got %r" % (archive,))
        return self.argv("load", "-i", archive)

    def load_stdin_argv(self) -> list:
        """Load an image archive (docker-archive) written to the engine's stdin:
        the archive inside a runtime image is streamed, never copied to disk first."""
        return self.argv("load")

    def image_exists_argv(self, image: str) -> list:
        """Exit status 0 when the engine holds ``image`` (both engines' ``image inspect``)."""
        return self.argv("image", "inspect", "--format", "{{.Id}}", _check_image(image))

    def gpu_args(self, vendor, cdi: bool = False) -> list:
        """How the container gets the machine's GPUs.

        NVIDIA: Podman through CDI (the specs of ``nvidia-ctk cdi generate``);
        Docker through its ``--gpus`` (the NVIDIA runtime hook), or CDI when the
        machine says its specs exist (``cdi``).  AMD: the device nodes ROCm
        opens and the group owning them.  ``--security-opt seccomp=unconfined``,
        often advised for ROCm, is left out on purpose: it lifts the whole
        syscall filter, and only NUMA memory calls of some HPC workloads need
        it; an image that does can ask for it in its own settings later.
        """
        if vendor in (None, ""):
            return []
        if vendor == NVIDIA:
            if self.name == "podman" or cdi:
                return ["--device", "nvidia.com/gpu=all"]
            return ["--gpus", "all"]
        if vendor == AMD:
            return ["--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video"]
        raise AgentError(BAD_INPUT, "Unknown GPU vendor %r (known: %s, or none)"
                         % (vendor, ", ".join(GPU_VENDORS)))

    def run_argv(self, cluster: str, machine: str, image: str, command, store: str, env_names=(),
                 gpu=None, cdi: bool = False, ipc: str = "host", shm_size_mib=None, secrets_dir=None) -> list:
        """``run`` of the cluster's runtime container (see the module's docstring)."""
        name = container_name(cluster)
        check_machine(machine)
        _check_image(image)
        _check_command(command)
        for path, what in ((store, "The store"), (secrets_dir or "/", "The secrets directory")):
            if not isinstance(path, str) or not os.path.isabs(path) or ":" in path or "," in path:
                raise AgentError(BAD_INPUT, "%s must be an absolute path without ':' or ',' "
                                            "(the engine's mount syntax), got %r" % (what, path))
        if ipc == "host":
            if shm_size_mib is not None:
                raise AgentError(BAD_INPUT, "With host IPC the container uses the machine's /dev/shm: "
                                            "a shared-memory size needs ipc \"private\"")
            shm = []
        elif ipc == "private":
            shm = ["--shm-size", "%dm" % _whole(shm_size_mib, "The shared-memory size (MiB)", 64, 1 << 24)]
        else:
            raise AgentError(BAD_INPUT, "ipc must be \"host\" or \"private\", got %r" % (ipc,))
        argv = self.argv("run", "--detach", "--name", name, "--restart", "no",
                         "--network", "host", "--ipc", ipc)
        argv += shm
        argv += ["--label", "%s=%s" % (CLUSTER_LABEL, cluster), "--label", "%s=%s" % (MACHINE_LABEL, machine)]
        argv += ["--cap-drop", "all"]
        for capability in CAPABILITIES:
            argv += ["--cap-add", capability]
        argv += ["--security-opt", "no-new-privileges"]
        argv += store_mounts(store)
        if secrets_dir:
            argv += ["-v", "%s:%s:ro" % (secrets_dir, SECRETS_IN_CONTAINER)]
        argv += self.ulimit_args
        for env_name in check_env_names(env_names):
            argv += ["-e", env_name]
        argv += self.gpu_args(gpu, cdi)
        # "--" is not needed: the image ends the options, and the command follows it as is.
        return argv + [image] + list(command)

    def exec_argv(self, cluster: str, command, env_names=(), detach: bool = False, settings=None) -> list:
        """Run ``command`` inside the cluster's running container (``ray start``,
        the status script, a model's copy with ``detach``: the engine returns at
        once and the command runs on); variables by name only, as for ``run``,
        but ``settings``: values that are no secret (``SETTINGS``: Ray's token
        mode and the token file's path), as ``NAME=VALUE``."""
        argv = self.argv("exec", "--detach") if detach else self.argv("exec")
        for env_name in check_env_names(env_names):
            argv += ["-e", env_name]
        for env_name, value in sorted((settings or {}).items()):
            if env_name not in SETTINGS or not isinstance(value, str) or "\0" in value or "\n" in value:
                raise AgentError(BAD_INPUT, "Only %s may be given by value on exec, not %r"
                                 % (", ".join(SETTINGS), env_name))
            argv += ["-e", "%s=%s" % (env_name, value)]
        return argv + [container_name(cluster)] + _check_command(command)

    def stop_argv(self, cluster: str, timeout: int = 30) -> list:
        """Stop: SIGTERM, then SIGKILL after ``timeout`` seconds."""
        return self.argv("stop", "-t", str(_whole(timeout, "The stop timeout", 0, STOP_TIMEOUT_MAX)),
                         container_name(cluster))

    def rm_argv(self, cluster: str = None, name: str = None) -> list:
        """Remove (running or not) a cluster's container, or one named by ``ps``."""
        if name is None:
            name = container_name(cluster)
        elif not name.startswith(NAME_PREFIX) or not CLUSTER_RE.match(name[len(NAME_PREFIX):]):
            raise AgentError(BAD_INPUT, "Only Fadenstack's containers are removed here, not %r" % (name,))
        return self.argv("rm", "-f", name)

    def inspect_argv(self, cluster: str) -> list:
        """The container's state as one JSON object (``parse_state``)."""
        return self.argv("inspect", "--format", "{{json .State}}", container_name(cluster))

    def logs_argv(self, cluster: str, lines: int = 50) -> list:
        """The last lines of its log: the machine's own words for a failed start."""
        return self.argv("logs", "--tail", str(_whole(lines, "The number of log lines", 1, LOG_LINES_MAX)),
                         container_name(cluster))

    def ps_argv(self, machine: str = None) -> list:
        """Every container of any cluster, running or not (``parse_ps``); with
        ``machine``, only those made for that machine (machines of a lab host
        share one engine, and one machine must not remove another's).

        Docker's ``{{json .}}`` gives a JSON object per line (labels as
        ``k=v,k=v``); Podman's ``json`` gives one array (labels as an object).
        """
        fmt = "{{json .}}" if self.name == "docker" else "json"
        label = CLUSTER_LABEL if machine is None else "%s=%s" % (MACHINE_LABEL, check_machine(machine))
        return self.argv("ps", "-a", "--filter", "label=" + label, "--format", fmt)


def store_mounts(store: str) -> list:
    """The store read-only, and over it read-write each of ``WRITABLE`` (the engine mounts them in
    order of their paths in the container, so the store comes first)."""
    argv = ["-v", "%s:%s:ro" % (store, STORE_IN_CONTAINER)]
    for sub in WRITABLE:
        argv += ["-v", "%s/%s:%s/%s" % (store.rstrip("/"), sub, STORE_IN_CONTAINER, sub)]
    return argv


def _check_image(image) -> str:
    if not isinstance(image, str) or not image or image.startswith("-") or re.search(r"\s", image):
        raise AgentError(BAD_INPUT, "The image must be a reference or an ID, got %r" % (image,))
    return image


def _check_command(command) -> list:
    if (not isinstance(command, (list, tuple)) or not command
            or any(not isinstance(part, str) for part in command) or not command[0]):
        raise AgentError(BAD_INPUT, "The container's command must be a non-empty list of "
                                    "arguments, got %r" % (command,))
    return list(command)
