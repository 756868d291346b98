"""Pure parsers: recorded tool output in, plain data out (no I/O here).

Each function takes the text a tool printed and returns JSON-ready data, or
raises ``ToolOutputError`` when the text is a tool's failure message or is
not in the expected shape.  ``facts`` runs the tools and turns those errors
into ``warnings`` entries.
"""

import csv
import json
import re

MIB = 1024 * 1024


class ToolOutputError(ValueError):
    """The tool ran but printed something we cannot use (message = why)."""


# ---------------------------------------------------------------- accelerators

_NA = {"", "[n/a]", "n/a", "[not supported]", "[unknown error]", "[insufficient permissions]"}
_NVIDIA_NO_DEVICES = "no devices were found"


def normalize_pci_bus_id(value):
    """``00000000:18:00.0`` (nvidia-smi) / ``0000:18:00.0`` -> ``0000:18:00.0``."""
    if value is None:
        return None
    value = value.strip().lower()
    m = re.match(r"^([0-9a-f]+):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$", value)
    if not m:
        return value or None
    return "%04x:%s:%s.%s" % (int(m.group(1), 16), m.group(2), m.group(3), m.group(4))


def _int_or_none(value):
    value = (value or "").strip()
    if value.lower() in _NA:
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def parse_nvidia_smi_csv(text: str) -> list:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,uuid,pci.bus_id
    --format=csv,noheader,nounits``.

    Empty output or "No devices were found" means a driver without GPUs: [].
    """
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    if not lines or (len(lines) == 1 and lines[0].strip().lower() == _NVIDIA_NO_DEVICES):
        return []
    gpus = []
    for row in csv.reader(lines, skipinitialspace=True):
        if len(row) != 5:
            raise ToolOutputError(_first_line(text))
        index, name, memory, uuid, bus = (field.strip() for field in row)
        if not index.isdigit():
            raise ToolOutputError(_first_line(text))
        gpus.append({
            "index": int(index),
            "vendor": "nvidia",
            "model": name,
            "memory_mib": _int_or_none(memory),
            "uuid": None if uuid.lower() in _NA else uuid,
            "pci_bus_id": None if bus.lower() in _NA else normalize_pci_bus_id(bus),
        })
    return sorted(gpus, key=lambda g: g["index"])


_NVIDIA_NO_PROCESSES = "no running processes found"


def parse_nvidia_compute_apps(text: str) -> list:
    """Parse ``nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory
    --format=csv,noheader,nounits``: one line per process and GPU (a process
    on two GPUs is two lines), ``[{"gpu_uuid", "pid", "used_memory_mib"}]``.

    No line, or "No running processes found", means no process holds a GPU.
    ``used_memory_mib`` is None where the driver does not say ("[N/A]", as
    it prints without the permission to look inside another's process).
    """
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    if not lines or (len(lines) == 1 and lines[0].strip().lower() == _NVIDIA_NO_PROCESSES):
        return []
    found = []
    for row in csv.reader(lines, skipinitialspace=True):
        if len(row) != 3:
            raise ToolOutputError(_first_line(text))
        uuid, pid, memory = (field.strip() for field in row)
        if not pid.isdigit() or int(pid) <= 0 or not uuid or uuid.lower() in _NA:
            raise ToolOutputError(_first_line(text))
        found.append({"gpu_uuid": uuid, "pid": int(pid), "used_memory_mib": _int_or_none(memory)})
    return found


def _first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:500]
    return "no output"


def _json_object_in(text: str):
    """rocm-smi may print warnings before its JSON: parse from the first '{'."""
    start = (text or "").find("{")
    if start < 0:
        raise ToolOutputError(_first_line(text))
    try:
        data = json.loads(text[start:])
    except ValueError:
        raise ToolOutputError("unparsable JSON: " + _first_line(text[start:]))
    if not isinstance(data, dict):
        raise ToolOutputError("expected a JSON object")
    return data


def parse_rocm_smi_json(text: str) -> list:
    """Parse ``rocm-smi --showproductname --showmeminfo vram [--showuniqueid
    --showbus] --json``: ``{"card0": {"Card series": ..., "VRAM Total Memory
    (B)": ...}, ...}`` (key case varies between rocm-smi releases)."""
    if not (text or "").strip():
        return []
    data = _json_object_in(text)
    gpus = []
    for key, card in data.items():
        m = re.match(r"^card(\d+)$", key)
        if not m or not isinstance(card, dict):
            continue
        fields = {str(k).strip().lower(): str(v).strip() for k, v in card.items()}
        model = None
        for name in ("card series", "card sku", "card model", "device name"):
            if fields.get(name) and fields[name].lower() not in _NA:
                model = fields[name]
                break
        total = _int_or_none(fields.get("vram total memory (b)"))
        uuid = fields.get("unique id") or fields.get("uuid")
        gpus.append({
            "index": int(m.group(1)),
            "vendor": "amd",
            "model": model,
            "memory_mib": None if total is None else total // MIB,
            "uuid": None if not uuid or uuid.lower() in _NA else uuid,
            "pci_bus_id": normalize_pci_bus_id(fields.get("pci bus")) if fields.get("pci bus") else None,
        })
    return sorted(gpus, key=lambda g: g["index"])


# ---------------------------------------------------------------- host

def parse_meminfo_total_mib(text: str):
    """``MemTotal:       263856208 kB`` from /proc/meminfo -> MiB (int)."""
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text or "", re.MULTILINE)
    if not m:
        raise ToolOutputError("no MemTotal line in /proc/meminfo")
    return int(m.group(1)) // 1024


def parse_docker_version(text: str):
    """``docker version --format '{{.Server.Version}}'`` -> "24.0.7" or None."""
    line = _first_line(text) if (text or "").strip() else ""
    return line if re.match(r"^\d+[\w.+~-]*$", line) else None


def parse_cli_version(text: str):
    """``podman --version`` ("podman version 4.3.1") -> "4.3.1", ``docker
    --version`` ("Docker version 20.10.24+dfsg1, build 5d6db84") ->
    "20.10.24+dfsg1", or None."""
    m = re.search(r"version\s+(\d[\w.+~-]*)", text or "")
    return m.group(1) if m else None



# ---------------------------------------------------------------- network

VPN_NAME = re.compile(r"^(wg|tun|tap|tailscale|zt|ppp|ipsec|utun|nebula)", re.IGNORECASE)
VPN_KINDS = {"wireguard", "tun", "tap", "xfrm", "vti", "vti6", "ppp"}
VIRTUAL_NAME = re.compile(
    r"^(docker\d*$|docker_gwbridge$|br-[0-9a-f]{12}$|virbr|cni|flannel|cali|vxlan\.calico$|"
    r"kube-|cilium_|lxc|lxdbr|podman|weave|ifb\d|nodelocaldns$)")
VIRTUAL_KINDS = {"dummy", "ifb", "vxlan", "geneve", "nlmon", "vrf"}
BRIDGE_KINDS = {"bridge", "openvswitch"}


def parse_ip_addr_json(text: str) -> list:
    """``ip [-d] -j addr show`` -> links with the fields we use, in ifindex order."""
    try:
        data = json.loads(text or "[]")
    except ValueError:
        raise ToolOutputError("ip printed unparsable JSON: " + _first_line(text))
    if not isinstance(data, list):
        raise ToolOutputError("ip printed JSON that is not a list")
    links = []
    for item in data:
        if not isinstance(item, dict) or not item.get("ifname"):
            continue
        info = item.get("linkinfo") or {}
        links.append({
            "ifindex": item.get("ifindex"),
            "name": item["ifname"],
            "mac": item.get("address"),
            "mtu": item.get("mtu"),
            "operstate": item.get("operstate"),
            "flags": list(item.get("flags") or []),
            "link_type": item.get("link_type"),
            "link_kind": info.get("info_kind"),
            "slave_kind": info.get("info_slave_kind"),
            "master": item.get("master"),
            "addr_info": [a for a in (item.get("addr_info") or []) if isinstance(a, dict)],
        })
    return sorted(links, key=lambda link: (link["ifindex"] is None, link["ifindex"] or 0))


def parse_ip_route_default_json(text: str) -> set:
    """``ip -j [-6] route show default`` -> names of devices carrying a default route."""
    try:
        data = json.loads(text or "[]")
    except ValueError:
        raise ToolOutputError("ip printed unparsable JSON: " + _first_line(text))
    devices = set()
    for route in data if isinstance(data, list) else []:
        if not isinstance(route, dict) or route.get("dst", "default") != "default":
            continue
        if route.get("type") in ("unreachable", "prohibit", "blackhole"):
            continue
        if route.get("dev"):
            devices.add(route["dev"])
        for hop in route.get("nexthops") or []:
            if isinstance(hop, dict) and hop.get("dev"):
                devices.add(hop["dev"])
    return devices


def parse_sys_speed(text):
    """/sys/class/net/NAME/speed -> Mb/s, None for -1 / unknown."""
    try:
        value = int((text or "").strip())
    except ValueError:
        return None
    return value if value > 0 else None


def parse_ethtool_speed(text):
    """``ethtool NAME`` -> Mb/s from "Speed: 10000Mb/s", None for "Unknown!"."""
    m = re.search(r"^\s*Speed:\s*([\d.]+)\s*([MG])b/s", text or "", re.MULTILINE)
    if not m:
        return None
    value = float(m.group(1)) * (1000 if m.group(2) == "G" else 1)
    return int(value) if value > 0 else None


def classify_interface(link: dict) -> str:
    """One of loopback / vpn / bridge / virtual / physical for a parsed link.

    Lab machines use veth pairs as their NICs, so a veth counts as physical
    unless it is enslaved to a bridge (the host end of a container's link).
    """
    name = link.get("name") or ""
    kind = (link.get("link_kind") or "").lower()
    if name == "lo" or link.get("link_type") == "loopback" or "LOOPBACK" in link.get("flags", ()):
        return "loopback"
    if VPN_NAME.match(name) or kind in VPN_KINDS:
        return "vpn"
    if VIRTUAL_NAME.match(name) or kind in VIRTUAL_KINDS:
        return "virtual"
    if kind in BRIDGE_KINDS:
        return "bridge"
    if kind == "veth" and link.get("master"):
        return "virtual"          # host end of a container / VM link
    return "physical"


def interface_state(link: dict) -> str:
    """Lower-case operstate; UNKNOWN (loopback, wireguard) resolved from flags."""
    state = (link.get("operstate") or "unknown").lower()
    if state == "unknown":
        flags = link.get("flags") or ()
        if "UP" in flags and "LOWER_UP" in flags:
            return "up"
        if "UP" not in flags:
            return "down"
    return state


def interface_addresses(addr_info: list) -> list:
    """["198.18.0.11/24", "2001:db8::11/64"]; IPv6 link-local (scope link) left out,
    since every interface has one and they would look like a shared network."""
    out = []
    for a in addr_info:
        local, plen = a.get("local"), a.get("prefixlen")
        if not local or plen is None:
            continue
        if a.get("family") == "inet6" and a.get("scope") == "link":
            continue
        out.append("%s/%s" % (local, plen))
    return out


def build_interfaces(addr_text: str, route_texts=(), speeds=None) -> list:
    """Combine ``ip -j addr``, default-route listings and speeds (name -> Mb/s)."""
    links = parse_ip_addr_json(addr_text)
    default_devs = set()
    for text in route_texts:
        default_devs |= parse_ip_route_default_json(text)
    speeds = speeds or {}
    return [{
        "name": link["name"],
        "kind": classify_interface(link),
        "mac": link["mac"],
        "mtu": link["mtu"],
        "state": interface_state(link),
        "addresses": interface_addresses(link["addr_info"]),
        "speed_mbps": speeds.get(link["name"]),
        "default_route": link["name"] in default_devs,
        "master": link["master"],
    } for link in links]


def parse_os_release(text: str):
    """/etc/os-release -> PRETTY_NAME (e.g. "Ubuntu 22.04.4 LTS") or None."""
    m = re.search(r"^PRETTY_NAME=(.*)$", text or "", re.MULTILINE)
    if not m:
        return None
    value = m.group(1).strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    return value or None
