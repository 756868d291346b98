"""The pure parsers against recorded tool output, and the facts collector fed
with those recordings through a fake tool runner."""

import json
import os

import pytest

from fadenstack_agent import facts, parsers
from fadenstack_agent.parsers import ToolOutputError

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def fixture_text(name: str) -> str:
    with open(os.path.join(FIXTURES, name), "r", encoding="utf-8") as fh:
        return fh.read()

# ------------------------------------------------------------------ nvidia-smi


def test_nvidia_h100_host():
    gpus = parsers.parse_nvidia_smi_csv(fixture_text("nvidia_smi_h100x8.csv"))
    assert [g["index"] for g in gpus] == list(range(8))
    assert {g["model"] for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g["memory_mib"] for g in gpus} == {81559}
    assert {g["vendor"] for g in gpus} == {"nvidia"}
    assert gpus[0]["uuid"] == "GPU-6513270e-269e-4d37-b2a7-4de452e6b438"
    assert [g["pci_bus_id"] for g in gpus][:2] == ["0000:18:00.0", "0000:2a:00.0"]
    assert len({g["uuid"] for g in gpus}) == 8
    assert set(gpus[0]) == {"index", "vendor", "model", "memory_mib", "uuid", "pci_bus_id"}


def test_nvidia_a100_host():
    gpus = parsers.parse_nvidia_smi_csv(fixture_text("nvidia_smi_a100x4.csv"))
    assert len(gpus) == 4
    assert gpus[3] == {"index": 3, "vendor": "nvidia", "model": "NVIDIA A100-PCIE-40GB",
                       "memory_mib": 40960, "uuid": gpus[3]["uuid"], "pci_bus_id": "0000:e3:00.0"}


@pytest.mark.parametrize("name", ["nvidia_smi_empty.csv", "nvidia_smi_no_devices.txt"])
def test_nvidia_driver_without_gpus(name):
    assert parsers.parse_nvidia_smi_csv(fixture_text(name)) == []


def test_nvidia_driver_failure_is_an_error_with_the_tools_words():
    with pytest.raises(ToolOutputError) as err:
        parsers.parse_nvidia_smi_csv(fixture_text("nvidia_smi_no_driver.txt"))
    assert "couldn't communicate with the NVIDIA driver" in str(err.value)


def test_nvidia_not_available_fields_and_order():
    text = ("1, NVIDIA GH200 480GB, [N/A], GPU-1, 00000009:01:00.0\n"
            "0, NVIDIA GH200 480GB, 97871, [N/A], 00000019:01:00.0\n")
    gpus = parsers.parse_nvidia_smi_csv(text)
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["uuid"] is None and gpus[1]["memory_mib"] is None
    assert gpus[0]["pci_bus_id"] == "0019:01:00.0"


@pytest.mark.parametrize("text", ["index, name\n", "Failed to initialize NVML: Driver/library version mismatch\n",
                                  "x, a, 1, GPU-1, 0000:01:00.0\n"])
def test_nvidia_unexpected_output_raises(text):
    with pytest.raises(ToolOutputError):
        parsers.parse_nvidia_smi_csv(text)


# ------------------------------------------------------------------ rocm-smi


def test_rocm_mi300x_host():
    gpus = parsers.parse_rocm_smi_json(fixture_text("rocm_smi_mi300x8.json"))
    assert [g["index"] for g in gpus] == list(range(8))
    assert {g["vendor"] for g in gpus} == {"amd"}
    assert {g["model"] for g in gpus} == {"AMD Instinct MI300X OAM"}
    assert {g["memory_mib"] for g in gpus} == {196608}
    assert gpus[0]["pci_bus_id"] == "0000:05:00.0" and gpus[5]["pci_bus_id"] == "0000:a6:00.0"
    assert all(g["uuid"].startswith("0x") for g in gpus)


def test_rocm_shape_from_the_brief():
    text = json.dumps({"card0": {"Card series": "AMD Instinct MI300X", "Card model": "0x74a1",
                                 "VRAM Total Memory (B)": "206158430208",
                                 "VRAM Total Used Memory (B)": "11137024"}})
    assert parsers.parse_rocm_smi_json(text) == [{
        "index": 0, "vendor": "amd", "model": "AMD Instinct MI300X", "memory_mib": 196608,
        "uuid": None, "pci_bus_id": None}]


def test_rocm_legacy_output_with_warning_line_and_system_block():
    gpus = parsers.parse_rocm_smi_json(fixture_text("rocm_smi_legacy_2cards.json"))
    assert [(g["index"], g["model"]) for g in gpus] == [(0, "AMD Instinct MI300X"), (1, "AMD Instinct MI300X")]


@pytest.mark.parametrize("text", ["ERROR: GPU[0] : Unable to read\n", "{not json", "[1, 2]"])
def test_rocm_unusable_output_raises(text):
    with pytest.raises(ToolOutputError):
        parsers.parse_rocm_smi_json(text)


# ------------------------------------------------------------------ network


def _h100_interfaces(speeds=None):
    return {i["name"]: i for i in parsers.build_interfaces(
        fixture_text("ip_addr_h100_host.json"),
        [fixture_text("ip_route_default_h100_host.json"), fixture_text("ip_route6_default_h100_host.json")],
        speeds)}


def test_h100_host_interface_kinds():
    kinds = {name: i["kind"] for name, i in _h100_interfaces().items()}
    assert kinds == {
        "lo": "loopback", "eno1": "physical", "eno2": "physical", "ens1f0np0": "physical",
        "ens1f1np1": "physical", "ibp26s0": "physical", "bond0": "physical", "br0": "bridge",
        "docker0": "virtual", "veth3c9a1f2": "virtual", "wg0": "vpn", "tailscale0": "vpn",
    }


def test_h100_host_interface_details():
    ifs = _h100_interfaces({"eno1": 10000, "bond0": 200000})
    eno1 = ifs["eno1"]
    assert eno1 == {"name": "eno1", "kind": "physical", "mac": "3c:ec:ef:4a:12:c0", "mtu": 1500,
                    "state": "up", "addresses": ["198.18.0.11/24", "2001:db8:18::11/64"],
                    "speed_mbps": 10000, "default_route": True, "master": None}
    assert [n for n, i in ifs.items() if i["default_route"]] == ["eno1"]
    assert ifs["bond0"]["mtu"] == 9000 and ifs["bond0"]["addresses"] == ["198.19.10.11/24"]
    assert ifs["ens1f0np0"]["master"] == "bond0" and ifs["ens1f0np0"]["addresses"] == []
    assert ifs["wg0"]["mac"] is None and ifs["wg0"]["state"] == "up"
    assert ifs["wg0"]["addresses"] == ["10.200.0.11/24", "fd10:200::11/64"]
    assert ifs["tailscale0"]["addresses"] == ["100.101.7.42/32", "fd7a:115c:a1e0::e601:72a/128"]
    assert ifs["lo"]["state"] == "up" and ifs["lo"]["addresses"] == ["127.0.0.1/8", "::1/128"]
    assert ifs["docker0"]["addresses"] == ["172.17.0.1/16"]
    assert ifs["br0"]["speed_mbps"] is None
    assert list(ifs)[0] == "lo"


def test_lab_machine_veths_are_nics_and_wg0_is_vpn():
    ifs = {i["name"]: i for i in parsers.build_interfaces(
        fixture_text("ip_addr_lab_machine.json"),
        [fixture_text("ip_route_default_lab_machine.json"), fixture_text("ip_route6_default_lab_machine.json")])}
    assert {n: i["kind"] for n, i in ifs.items()} == {
        "lo": "loopback", "eth0": "physical", "eth1": "physical", "wg0": "vpn"}
    assert ifs["eth0"]["addresses"] == ["198.18.0.11/24", "fd00:18::11/64"]
    assert ifs["eth0"]["default_route"] and not ifs["eth1"]["default_route"]
    assert ifs["eth1"]["mtu"] == 9000


def test_output_without_details_still_classifies_by_name():
    ifs = {i["name"]: i for i in parsers.build_interfaces(
        fixture_text("ip_addr_plain_no_details.json"), [fixture_text("ip_route_default_plain.json")])}
    assert ifs["lo"]["kind"] == "loopback"
    assert ifs["eth0"]["kind"] == "physical" and ifs["eth0"]["default_route"]
    assert ifs["ifb0"]["kind"] == "virtual" and ifs["ifb0"]["state"] == "down"


@pytest.mark.parametrize("link, expected", [
    ({"name": "lo"}, "loopback"),
    ({"name": "wg-fabric"}, "vpn"),
    ({"name": "tun0", "link_kind": "tun"}, "vpn"),
    ({"name": "tap3"}, "vpn"),
    ({"name": "zt5u4y6kix"}, "vpn"),
    ({"name": "ppp0"}, "vpn"),
    ({"name": "nebula1"}, "vpn"),
    ({"name": "mesh0", "link_kind": "wireguard"}, "vpn"),
    ({"name": "br0", "link_kind": "bridge"}, "bridge"),
    ({"name": "ovsbr", "link_kind": "openvswitch"}, "bridge"),
    ({"name": "docker0", "link_kind": "bridge"}, "virtual"),
    ({"name": "br-0123456789ab", "link_kind": "bridge"}, "virtual"),
    ({"name": "virbr0", "link_kind": "bridge"}, "virtual"),
    ({"name": "cni0", "link_kind": "bridge"}, "virtual"),
    ({"name": "flannel.1", "link_kind": "vxlan"}, "virtual"),
    ({"name": "cali12ab", "link_kind": "veth"}, "virtual"),
    ({"name": "dummy0", "link_kind": "dummy"}, "virtual"),
    ({"name": "vethabc", "link_kind": "veth", "master": "docker0"}, "virtual"),
    ({"name": "vm1-eth0", "link_kind": "veth", "master": "br0"}, "virtual"),
    ({"name": "eth0", "link_kind": "veth"}, "physical"),
    ({"name": "enp65s0f0"}, "physical"),
    ({"name": "bond0", "link_kind": "bond"}, "physical"),
    ({"name": "eth0.100", "link_kind": "vlan"}, "physical"),
])
def test_classify_interface(link, expected):
    assert parsers.classify_interface(link) == expected


def test_default_routes_multipath_and_unreachable():
    text = json.dumps([
        {"dst": "default", "protocol": "static", "metric": 10, "flags": [],
         "nexthops": [{"gateway": "198.18.0.1", "dev": "eth0", "weight": 1, "flags": []},
                      {"gateway": "198.19.0.1", "dev": "eth1", "weight": 1, "flags": []}]},
        {"type": "unreachable", "dst": "default", "dev": "lo", "metric": 4278198272, "flags": []}])
    assert parsers.parse_ip_route_default_json(text) == {"eth0", "eth1"}
    assert parsers.parse_ip_route_default_json("[]") == set()
    assert parsers.parse_ip_route_default_json("") == set()


def test_ip_garbage_raises():
    with pytest.raises(ToolOutputError):
        parsers.parse_ip_addr_json("Object \"-j\" is unknown, try \"ip help\".")


@pytest.mark.parametrize("name, expected", [
    ("ethtool_mlx5_100g.txt", 100000), ("ethtool_eno1_10g.txt", 10000), ("ethtool_unknown_speed.txt", None)])
def test_ethtool_speed(name, expected):
    assert parsers.parse_ethtool_speed(fixture_text(name)) == expected


@pytest.mark.parametrize("text, expected", [("25000\n", 25000), ("-1\n", None), ("", None),
                                            (None, None), ("4294967295", 4294967295)])
def test_sys_speed(text, expected):
    assert parsers.parse_sys_speed(text) == expected


# ------------------------------------------------------------------ host


def test_meminfo():
    text = fixture_text("proc_meminfo.txt")
    kb = int(next(line.split()[1] for line in text.splitlines() if line.startswith("MemTotal:")))
    assert parsers.parse_meminfo_total_mib(text) == kb // 1024
    assert parsers.parse_meminfo_total_mib("MemTotal:       263856208 kB\n") == 257672
    with pytest.raises(ToolOutputError):
        parsers.parse_meminfo_total_mib("")


def test_small_version_parsers():
    assert parsers.parse_docker_version("24.0.7\n") == "24.0.7"
    assert parsers.parse_docker_version("") is None
    assert parsers.parse_docker_version("Cannot connect to the Docker daemon") is None
    assert parsers.parse_cli_version("podman version 4.3.1\n") == "4.3.1"
    assert parsers.parse_cli_version("Docker version 20.10.24+dfsg1, build 5d6db84\n") == "20.10.24+dfsg1"
    assert parsers.parse_os_release('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n') == "Ubuntu 22.04.4 LTS"
    assert parsers.parse_os_release("") is None


# ------------------------------------------------------------------ collector with recorded tools


class FakeTools:
    """Answers tool runs from recordings: {argv[0]: (rc, stdout, stderr)}; absent -> not installed."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def __call__(self, argv, timeout=facts.TIMEOUT):
        self.calls.append(list(argv))
        key = " ".join(argv[:1]) if argv[0] != "ip" else " ".join(argv)
        if argv[0] == "nvidia-smi" and argv[1].startswith("--query-compute-apps"):
            key = "nvidia-smi compute-apps"  # the GPUs' processes: a second question to the same tool
        if key not in self.answers:
            return None
        rc, out, err = self.answers[key]
        return facts.ToolRun(argv, rc, out, err)


def _ip_answers(prefix="h100_host"):
    return {
        "ip -d -j addr show": (0, fixture_text("ip_addr_%s.json" % prefix), ""),
        "ip -j route show default": (0, fixture_text("ip_route_default_%s.json" % prefix), ""),
        "ip -j -6 route show default": (0, fixture_text("ip_route6_default_%s.json" % prefix), ""),
        "uname": (0, "aarch64\n", ""),
        "ethtool": (0, fixture_text("ethtool_eno1_10g.txt"), ""),
    }


def _collect(tmp_path, answers, config=None):
    tools = FakeTools(answers)
    result = facts.Collector(store=str(tmp_path / "store"), config=config or {}, runner=tools).collect()
    json.dumps(result)
    return result, tools


def test_collector_nvidia_host(tmp_path):
    answers = _ip_answers()
    answers["nvidia-smi"] = (0, fixture_text("nvidia_smi_h100x8.csv"), "")
    result, tools = _collect(tmp_path, answers)
    assert result["arch"] == "aarch64"
    assert len(result["accelerators"]) == 8 and result["warnings"] == []
    assert result["store"]["path"] == str(tmp_path / "store") and result["store"]["free_bytes"] > 0
    assert result["container_runtime"] is None
    names = {i["name"]: i for i in result["interfaces"]}
    assert names["eno1"]["default_route"] and names["eno1"]["speed_mbps"] == 10000
    assert names["wg0"]["speed_mbps"] is None
    assert ["nvidia-smi", "--query-gpu=index,name,memory.total,uuid,pci.bus_id",
            "--format=csv,noheader,nounits"] in tools.calls
    assert all(isinstance(call, list) for call in tools.calls)


def test_collector_amd_host_and_process_runtime(tmp_path):
    answers = _ip_answers("lab_machine")
    answers["rocm-smi"] = (0, fixture_text("rocm_smi_mi300x8.json"), "")
    result, _ = _collect(tmp_path, answers, config={"runtime_driver": "process"})
    assert [a["vendor"] for a in result["accelerators"]] == ["amd"] * 8
    assert result["container_runtime"] == {"name": "process", "version": result["agent_version"]}
    assert result["warnings"] == []


def test_collector_failing_driver_is_a_warning(tmp_path):
    answers = _ip_answers()
    answers["nvidia-smi"] = (9, fixture_text("nvidia_smi_no_driver.txt"), "")
    answers["rocm-smi"] = (None, "", "")                 # timed out
    result, _ = _collect(tmp_path, answers)
    assert result["accelerators"] == []
    sources = [w["source"] for w in result["warnings"]]
    assert sources == ["nvidia-smi", "rocm-smi"]
    assert "couldn't communicate with the NVIDIA driver" in result["warnings"][0]["message"]
    assert "did not answer within" in result["warnings"][1]["message"]


def test_collector_no_devices_exit_status_is_not_a_warning(tmp_path):
    answers = _ip_answers()
    answers["nvidia-smi"] = (6, fixture_text("nvidia_smi_no_devices.txt"), "")
    result, _ = _collect(tmp_path, answers)
    assert result["accelerators"] == [] and result["warnings"] == []


def test_collector_container_runtimes(tmp_path):
    answers = _ip_answers()
    answers["docker"] = (0, "24.0.7\n", "")
    assert _collect(tmp_path, answers)[0]["container_runtime"] == {"name": "docker", "version": "24.0.7"}
    answers["docker"] = (1, "", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock.")
    result, _ = _collect(tmp_path, answers)
    assert result["container_runtime"] is None
    assert result["warnings"][0]["source"] == "docker"
    assert result["container_runtimes"] == [{"name": "docker", "version": None, "answers": False}]
    answers["podman"] = (0, "podman version 4.9.3\n", "")
    result, _ = _collect(tmp_path, answers)
    assert result["container_runtime"] == {"name": "podman", "version": "4.9.3"} and result["warnings"] == []
    assert [r["name"] for r in result["container_runtimes"]] == ["docker", "podman"]


def test_collector_lists_every_engine_whichever_the_machine_config_names(tmp_path):
    answers = _ip_answers()
    answers["docker"] = (0, "24.0.7\n", "")
    answers["podman"] = (0, "podman version 4.9.3\n", "")
    result, _ = _collect(tmp_path, answers, config={"runtime_driver": "process"})
    assert result["container_runtime"] == {"name": "process", "version": result["agent_version"]}
    assert result["container_runtimes"] == [{"name": "docker", "version": "24.0.7", "answers": True},
                                            {"name": "podman", "version": "4.9.3", "answers": True}]


def test_collector_without_ip_or_uname(tmp_path):
    result, _ = _collect(tmp_path, {})
    assert result["interfaces"] == []
    assert {w["source"] for w in result["warnings"]} == {"ip", "uname"}
    assert result["arch"]


def test_collector_falls_back_to_ip_without_details(tmp_path):
    answers = {"ip -d -j addr show": (255, "", "Option \"-d\" is unknown"),
               "ip -j addr show": (0, fixture_text("ip_addr_plain_no_details.json"), ""),
               "ip -j route show default": (0, fixture_text("ip_route_default_plain.json"), ""),
               "uname": (0, "x86_64\n", "")}
    result, _ = _collect(tmp_path, answers)
    assert [i["name"] for i in result["interfaces"]] == ["lo", "ifb0", "ifb1", "eth0"]
