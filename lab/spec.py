"""The lab's spec (TOML): networks and machines, validated, with addresses.

A spec has ``[[networks]]`` (name, subnet, interface, rate_mbit, and one of
them ``management = true``), an optional ``[defaults]`` table merged into
every machine, and ``[[machines]]`` (name, arch, networks, accelerators,
optional disk_mib). A machine's address on every network it is on is host
number 11 + its index in the spec; the host (the console) is .1 on each.
An optional ``[hub]`` table (rate_mbit, port) shapes the lab hub, a host of
its own at .250 on the management network (``lab/hub_host.py``). An optional
``[engine]`` table sets the lab's inference engine (``lab/stubs/vllm``):
``tokens_per_second``, the pace of each request's tokens, standing for a GPU's
decode time; ``prefill_tokens_per_second``, the pace of a prompt's prefill (0:
none), and ``prefix_cache_tokens``, what its prefix cache holds (vLLM's
automatic prefix caching); they reach the machines' engines through their agent config.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .hub import DEFAULT_PORT as DEFAULT_HUB_PORT
from .util import LabError

SPEC_DIR = Path(__file__).resolve().parent / "specs"
DEFAULT_SPEC = SPEC_DIR / "default.toml"

LAB_RANGE = ipaddress.ip_network("198.18.0.0/15")
FIRST_MACHINE_HOST = 11  # .1 is the host (bridge), machines from .11 on
HOST_NUMBER = 1
HUB_HOST = 250  # the lab hub on the management network: far above any machine (.11 + index)
HUB_NAME = "hub"  # its namespace is fl-hub, so no machine may be called that
DEFAULT_HUB_RATE_MBIT = 400
DEFAULT_ENGINE_PACE = 200  # tokens per second per request: a small model's decode on one GPU
MAX_IFNAME = 15  # Linux interface names: IFNAMSIZ - 1

NETWORK_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")
MACHINE_NAME = re.compile(r"^[a-z](?:[a-z0-9-]{0,30}[a-z0-9])?$")
INTERFACE_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,14}$")
ARCHES = {"x86_64", "aarch64", "ppc64le", "s390x", "riscv64"}
VENDORS = {"nvidia", "amd"}

NETWORK_KEYS = {"name", "subnet", "interface", "rate_mbit", "management"}
MACHINE_KEYS = {
    "name", "arch", "networks", "accelerators", "disk_mib", "runtime",
    "driver_version", "cuda_version", "rocm_version",
}
ACCELERATOR_KEYS = {"vendor", "model", "count", "memory_mib"}
HUB_KEYS = {"rate_mbit", "port"}
ENGINE_KEYS = {"tokens_per_second", "prefill_tokens_per_second", "prefix_cache_tokens"}


# A machine's container runtime: Podman as on a real machine, or `process` (Ray from the lab's own
# environment as plain processes), the fast path for tests that do not test the runtime itself.
RUNTIMES = ("podman", "process")

@dataclass(frozen=True)
class NetworkSpec:
    name: str
    subnet: ipaddress.IPv4Network
    interface: str  # the interface's name inside every machine on it
    rate_mbit: float
    management: bool = False

    @property
    def bridge(self) -> str:
        return f"flb-{self.name}"

    @property
    def host_address(self) -> str:
        return str(self.subnet.network_address + HOST_NUMBER)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "subnet": str(self.subnet),
            "bridge": self.bridge,
            "rate_mbit": self.rate_mbit,
            "interface": self.interface,
            "management": self.management,
            "host_address": self.host_address,
        }


@dataclass(frozen=True)
class AcceleratorSpec:
    vendor: str  # "nvidia" or "amd"
    model: str  # as the vendor's tool prints it, e.g. "NVIDIA H100 80GB HBM3"
    count: int
    memory_mib: int

    def to_json(self) -> dict:
        return {"vendor": self.vendor, "model": self.model, "count": self.count,
                "memory_mib": self.memory_mib}


@dataclass(frozen=True)
class MachineSpec:
    name: str
    index: int  # position in the spec: decides addresses and link names
    arch: str
    networks: tuple[str, ...]
    accelerators: tuple[AcceleratorSpec, ...]
    disk_mib: int | None = None  # a size-limited tmpfs store; None: a plain directory
    runtime: str = "podman"  # the runtime driver its agent uses: Podman, or the fast `process` path
    driver_version: str = "550.90.07"
    cuda_version: str = "12.4"
    rocm_version: str = "6.2.0"

    @property
    def netns(self) -> str:
        return f"fl-{self.name}"

    @property
    def host_number(self) -> int:
        return FIRST_MACHINE_HOST + self.index

    def host_link(self, network: str) -> str:
        """The host-side end of this machine's veth on a network."""
        return f"fl{self.index + 1}-{network}"

    def temp_link(self, network: str) -> str:
        """The machine-side end's name before it moves into the namespace."""
        return f"fm{self.index + 1}-{network}"

    def vendors(self) -> set[str]:
        return {accelerator.vendor for accelerator in self.accelerators if accelerator.count}


@dataclass(frozen=True)
class HubSpec:
    """The lab hub's link onto the management network and the port it answers on."""

    rate_mbit: float = DEFAULT_HUB_RATE_MBIT
    port: int = DEFAULT_HUB_PORT

    @property
    def netns(self) -> str:
        return f"fl-{HUB_NAME}"

    def host_link(self, network: str) -> str:
        """The host-side end of the hub's veth (``flh-mgmt``; machines' are ``fl1-mgmt`` ...)."""
        return f"flh-{network}"

    def temp_link(self, network: str) -> str:
        return f"fmh-{network}"


@dataclass(frozen=True)
class EngineSpec:
    """The lab's inference engine: how fast each request's tokens come (per request, not per machine), how fast a
    copy prefills prompts (0: it takes no time) and how many tokens its prefix cache holds (None: the engine's own
    default, 100,000)."""

    tokens_per_second: float = DEFAULT_ENGINE_PACE
    prefill_tokens_per_second: float = 0
    prefix_cache_tokens: int | None = None

    def environment(self) -> dict[str, str]:
        """What every copy's engine gets (the machines' agent config ``engine_env``): the prefill's pace and the
        cache's size only when the spec sets them."""
        env = {"FADEN_LAB_ENGINE_PACE": f"{self.tokens_per_second:g}"}
        if self.prefill_tokens_per_second:
            env["FADEN_LAB_ENGINE_PREFILL"] = f"{self.prefill_tokens_per_second:g}"
        if self.prefix_cache_tokens is not None:
            env["FADEN_LAB_ENGINE_PREFIX_CACHE"] = str(self.prefix_cache_tokens)
        return env


@dataclass(frozen=True)
class LabSpec:
    networks: tuple[NetworkSpec, ...]
    machines: tuple[MachineSpec, ...]
    hub: HubSpec = field(default_factory=HubSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    source: str = "<spec>"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def management(self) -> NetworkSpec:
        return next(network for network in self.networks if network.management)

    @property
    def console_address(self) -> str:
        return self.management.host_address

    def network(self, name: str) -> NetworkSpec:
        for network in self.networks:
            if network.name == name:
                return network
        raise KeyError(name)

    def machine(self, name: str) -> MachineSpec:
        for machine in self.machines:
            if machine.name == name:
                return machine
        raise KeyError(name)

    def address(self, machine: MachineSpec, network: str) -> str:
        return str(self.network(network).subnet.network_address + machine.host_number)

    @property
    def hub_address(self) -> str:
        return str(self.management.subnet.network_address + HUB_HOST)

    @property
    def hub_url(self) -> str:
        return f"http://{self.hub_address}:{self.hub.port}"

    def machine_json(self, machine: MachineSpec) -> dict:
        """The machine's spec as `status --json` and the stubs see it."""
        return {
            "name": machine.name,
            "arch": machine.arch,
            "accelerators": [accelerator.to_json() for accelerator in machine.accelerators],
            "networks": [
                {
                    "name": name,
                    "interface": self.network(name).interface,
                    "address": self.address(machine, name),
                    "prefix_length": self.network(name).subnet.prefixlen,
                    "gateway": self.network(name).host_address,
                    "rate_mbit": self.network(name).rate_mbit,
                    "default_route": self.network(name).management,
                }
                for name in machine.networks
            ],
            "disk": {
                "kind": "tmpfs" if machine.disk_mib else "directory",
                "mib": machine.disk_mib,
            },
            "driver_version": machine.driver_version,
            "cuda_version": machine.cuda_version,
            "rocm_version": machine.rocm_version,
        }


def load_spec(path: str | Path | None = None) -> LabSpec:
    """Read and validate a spec file (the default spec when path is None)."""
    path = Path(path) if path else DEFAULT_SPEC
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise LabError(f"spec {path}: no such file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise LabError(f"spec {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise LabError(f"spec {path}: not valid TOML: {exc}") from exc
    return parse_spec(raw, source=str(path))


def parse_spec(raw: dict, source: str = "<spec>") -> LabSpec:
    """Validate a spec already read from TOML; raise LabError naming the problem."""

    def fail(message: str) -> LabError:
        return LabError(f"spec {source}: {message}")

    unknown = set(raw) - {"lab", "networks", "defaults", "machines", "hub", "engine"}
    if unknown:
        raise fail(f"unknown top-level key(s): {', '.join(sorted(unknown))}")
    networks = tuple(_parse_network(item, fail) for item in _table_list(raw, "networks", fail))
    if not networks:
        raise fail("no [[networks]]")
    _check_networks(networks, fail)
    defaults = raw.get("defaults", {})
    if not isinstance(defaults, dict):
        raise fail("[defaults] must be a table")
    machine_tables = _table_list(raw, "machines", fail)
    if not machine_tables:
        raise fail("no [[machines]]")
    names = {network.name: network for network in networks}
    machines = tuple(
        _parse_machine({**defaults, **item}, index, names, fail)
        for index, item in enumerate(machine_tables)
    )
    seen: set[str] = set()
    for machine in machines:
        if machine.name in seen:
            raise fail(f"machine {machine.name} is listed twice")
        if machine.name == HUB_NAME:
            raise fail(f"machine name {HUB_NAME!r} is the lab hub's (its namespace is fl-{HUB_NAME}): pick another")
        seen.add(machine.name)
    for network in networks:
        last_host = network.subnet.num_addresses - 2  # below the broadcast address
        if FIRST_MACHINE_HOST + len(machines) - 1 > last_host:
            raise fail(f"network {network.name} ({network.subnet}) is too small "
                       f"for {len(machines)} machines from .{FIRST_MACHINE_HOST}")
    hub = _parse_hub(raw.get("hub", {}), fail)
    management = next(network for network in networks if network.management)
    if FIRST_MACHINE_HOST + len(machines) - 1 >= HUB_HOST or HUB_HOST > management.subnet.num_addresses - 2:
        raise fail(f"the lab hub is host .{HUB_HOST} of the management network {management.name} "
                   f"({management.subnet}): it needs a /24 or larger and at most "
                   f"{HUB_HOST - FIRST_MACHINE_HOST} machines")
    engine = _parse_engine(raw.get("engine", {}), fail)
    return LabSpec(networks=networks, machines=machines, hub=hub, engine=engine, source=source, raw=raw)


def _parse_engine(item, fail) -> EngineSpec:
    if not isinstance(item, dict):
        raise fail("[engine] must be a table")
    unknown = set(item) - ENGINE_KEYS
    if unknown:
        raise fail(f"[engine]: unknown key(s): {', '.join(sorted(unknown))}")
    pace = item.get("tokens_per_second", DEFAULT_ENGINE_PACE)
    if isinstance(pace, bool) or not isinstance(pace, (int, float)) or not 0 < pace <= 1_000_000:
        raise fail("[engine]: tokens_per_second must be a number of tokens per second (0 < pace <= 1000000)")
    prefill = item.get("prefill_tokens_per_second", 0)
    if isinstance(prefill, bool) or not isinstance(prefill, (int, float)) or not 0 <= prefill <= 1_000_000_000:
        raise fail("[engine]: prefill_tokens_per_second must be a number of prompt tokens per second "
                   "(0, no time, to 1000000000)")
    cache = item.get("prefix_cache_tokens")
    if cache is not None and (isinstance(cache, bool) or not isinstance(cache, int) or not 0 <= cache <= 1_000_000_000):
        raise fail("[engine]: prefix_cache_tokens must be a whole number of tokens (0 to 1000000000)")
    return EngineSpec(tokens_per_second=pace, prefill_tokens_per_second=prefill, prefix_cache_tokens=cache)


def _parse_hub(item, fail) -> HubSpec:
    if not isinstance(item, dict):
        raise fail("[hub] must be a table")
    unknown = set(item) - HUB_KEYS
    if unknown:
        raise fail(f"[hub]: unknown key(s): {', '.join(sorted(unknown))}")
    rate = item.get("rate_mbit", DEFAULT_HUB_RATE_MBIT)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 100_000:
        raise fail("[hub]: rate_mbit must be a number of Mbit/s (0 < rate <= 100000)")
    port = item.get("port", DEFAULT_HUB_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise fail(f"[hub]: port {port!r} is not a TCP port number")
    return HubSpec(rate_mbit=rate, port=port)


def _table_list(raw: dict, key: str, fail) -> list[dict]:
    items = raw.get(key, [])
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise fail(f"{key} must be an array of tables ([[{key}]])")
    return items


def _parse_network(item: dict, fail) -> NetworkSpec:
    name = item.get("name")
    if not isinstance(name, str) or not NETWORK_NAME.match(name):
        raise fail(f"network name {name!r}: use 1-10 lowercase letters and digits")
    unknown = set(item) - NETWORK_KEYS
    if unknown:
        raise fail(f"network {name}: unknown key(s): {', '.join(sorted(unknown))}")
    try:
        subnet = ipaddress.IPv4Network(item.get("subnet", ""), strict=True)
    except (ValueError, TypeError) as exc:
        raise fail(f"network {name}: subnet: {exc}") from exc
    if not subnet.subnet_of(LAB_RANGE):
        raise fail(f"network {name}: subnet {subnet} is outside {LAB_RANGE}")
    interface = item.get("interface")
    if not isinstance(interface, str) or not INTERFACE_NAME.match(interface) or interface == "lo":
        raise fail(f"network {name}: interface {interface!r} is not a valid interface name")
    rate = item.get("rate_mbit")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 100_000:
        raise fail(f"network {name}: rate_mbit must be a number of Mbit/s (0 < rate <= 100000)")
    management = item.get("management", False)
    if not isinstance(management, bool):
        raise fail(f"network {name}: management must be true or false")
    return NetworkSpec(name=name, subnet=subnet, interface=interface, rate_mbit=rate,
                       management=management)


def _check_networks(networks: tuple[NetworkSpec, ...], fail) -> None:
    managements = [network.name for network in networks if network.management]
    if len(managements) != 1:
        raise fail("exactly one network must have management = true "
                   f"(found {len(managements)})")
    for position, network in enumerate(networks):
        for other in networks[position + 1:]:
            if network.name == other.name:
                raise fail(f"network {network.name} is listed twice")
            if network.subnet.overlaps(other.subnet):
                raise fail(f"networks {network.name} and {other.name} overlap")


def _parse_machine(item: dict, index: int, networks: dict, fail) -> MachineSpec:
    name = item.get("name")
    if not isinstance(name, str) or not MACHINE_NAME.match(name):
        raise fail(f"machine name {name!r}: use a hostname (lowercase letters, digits, '-')")
    unknown = set(item) - MACHINE_KEYS
    if unknown:
        raise fail(f"machine {name}: unknown key(s): {', '.join(sorted(unknown))}")
    arch = item.get("arch", "x86_64")
    if arch not in ARCHES:
        raise fail(f"machine {name}: arch {arch!r} is not one of {', '.join(sorted(ARCHES))}")
    on = item.get("networks")
    if not isinstance(on, list) or not all(isinstance(n, str) for n in on) or not on:
        raise fail(f"machine {name}: networks must be a list of network names")
    for network in on:
        if network not in networks:
            raise fail(f"machine {name}: no network named {network!r}")
    if len(set(on)) != len(on):
        raise fail(f"machine {name}: a network is listed twice")
    management = next(n for n in networks.values() if n.management)
    if management.name not in on:
        raise fail(f"machine {name}: must be on the management network {management.name}")
    interfaces = [networks[network].interface for network in on]
    if len(set(interfaces)) != len(interfaces):
        raise fail(f"machine {name}: two of its networks use the same interface name")
    for network in on:
        for link in (f"fl{index + 1}-{network}", f"fm{index + 1}-{network}"):
            if len(link) > MAX_IFNAME:
                raise fail(f"machine {name}: link name {link} is longer than {MAX_IFNAME}")
    accelerators = item.get("accelerators", [])
    if not isinstance(accelerators, list):
        raise fail(f"machine {name}: accelerators must be a list of tables")
    disk_mib = item.get("disk_mib")
    if disk_mib is not None and (isinstance(disk_mib, bool) or not isinstance(disk_mib, int)
                                 or disk_mib < 1):
        raise fail(f"machine {name}: disk_mib must be a positive whole number of MiB")
    runtime = item.get("runtime", "podman")
    if runtime not in RUNTIMES:
        raise fail(f"machine {name}: runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
    versions = {}
    for key in ("driver_version", "cuda_version", "rocm_version"):
        if key in item:
            if not isinstance(item[key], str):
                raise fail(f"machine {name}: {key} must be a string")
            versions[key] = item[key]
    return MachineSpec(
        name=name,
        index=index,
        arch=arch,
        networks=tuple(on),
        accelerators=tuple(_parse_accelerator(a, name, fail) for a in accelerators),
        disk_mib=disk_mib,
        runtime=runtime,
        **versions,
    )


def _parse_accelerator(item, machine: str, fail) -> AcceleratorSpec:
    if not isinstance(item, dict):
        raise fail(f"machine {machine}: each accelerator must be a table")
    unknown = set(item) - ACCELERATOR_KEYS
    if unknown:
        raise fail(f"machine {machine}: accelerator: unknown key(s): {', '.join(sorted(unknown))}")
    vendor = item.get("vendor")
    if vendor not in VENDORS:
        raise fail(f"machine {machine}: accelerator vendor {vendor!r} is not one of "
                   f"{', '.join(sorted(VENDORS))}")
    model = item.get("model")
    if not isinstance(model, str) or not model.strip():
        raise fail(f"machine {machine}: accelerator model must be a name")
    count = item.get("count", 1)
    memory = item.get("memory_mib")
    for key, value in (("count", count), ("memory_mib", memory)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "count" else 1):
            raise fail(f"machine {machine}: accelerator {key} must be a whole number")
    return AcceleratorSpec(vendor=vendor, model=model, count=count, memory_mib=memory)
