"""The lab: unit tests of its spec and stubs, and integration tests of a running lab.

The integration tests (marked `lab`) need root: they take the test run's lab
(tests/lab_fixtures.py) down and put it up anew, and take it down at the end,
checking that nothing is left behind.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import cli as lab_cli
from lab import machine as lab_machine
from lab import spec as lab_spec
from lab import util as lab_util

REPO = Path(__file__).resolve().parents[2]
LAB_STUBS = REPO / "lab" / "stubs"
FINGERPRINT = re.compile(r"^SHA256:[A-Za-z0-9+/]{43}$")


# --------------------------------------------------------------------------
# The spec (no root needed)


def minimal_spec(**changes) -> dict:
    raw = {
        "networks": [
            {"name": "mgmt", "subnet": "198.18.0.0/24", "interface": "eth0",
             "rate_mbit": 100, "management": True},
            {"name": "fabric", "subnet": "198.18.1.0/24", "interface": "eth1", "rate_mbit": 400},
        ],
        "machines": [
            {"name": "m-one", "networks": ["mgmt", "fabric"],
             "accelerators": [{"vendor": "nvidia", "model": "NVIDIA H100 80GB HBM3",
                               "count": 8, "memory_mib": 81559}]},
            {"name": "m-two", "networks": ["mgmt"]},
        ],
    }
    raw.update(changes)
    return raw


def test_default_spec_has_five_machines_on_four_networks():
    spec = lab_spec.load_spec()
    assert [m.name for m in spec.machines] == ["lab-a", "lab-b", "lab-c", "lab-d", "lab-e"]
    assert [(n.name, str(n.subnet), n.interface) for n in spec.networks] == [
        ("mgmt", "198.18.0.0/24", "eth0"),
        ("fabric", "198.18.1.0/24", "eth1"),
        ("slow", "198.18.2.0/24", "eth2"),
        ("wg0", "198.18.3.0/24", "wg0"),
    ]
    assert spec.management.name == "mgmt"
    assert spec.console_address == "198.18.0.1"
    rates = {n.name: n.rate_mbit for n in spec.networks}
    assert rates["slow"] * 10 == rates["fabric"]
    assert rates["fabric"] == max(rates.values())


def test_default_spec_puts_machines_on_the_networks_the_design_names():
    spec = lab_spec.load_spec()
    members = {n.name: [m.name for m in spec.machines if n.name in m.networks]
               for n in spec.networks}
    assert members == {
        "mgmt": ["lab-a", "lab-b", "lab-c", "lab-d", "lab-e"],
        "fabric": ["lab-a", "lab-b", "lab-c", "lab-d"],
        "slow": ["lab-a", "lab-b"],
        "wg0": ["lab-a", "lab-b", "lab-c"],
    }


def test_default_spec_machines_have_their_accelerators_and_arch():
    spec = lab_spec.load_spec()
    seen = {m.name: (m.arch, [(a.vendor, a.model, a.count, a.memory_mib) for a in m.accelerators])
            for m in spec.machines}
    assert seen["lab-a"] == ("x86_64", [("nvidia", "NVIDIA H100 80GB HBM3", 8, 81559)])
    assert seen["lab-b"] == seen["lab-a"]
    assert seen["lab-c"] == ("x86_64", [("nvidia", "NVIDIA A100-SXM4-40GB", 4, 40960)])
    assert seen["lab-d"][0] == "aarch64"
    assert seen["lab-d"][1][0][:3] == ("nvidia", "NVIDIA GH200 96GB", 4)
    assert seen["lab-e"] == ("x86_64", [("amd", "AMD Instinct MI300X", 8, 196608)])


def test_machine_address_is_host_11_plus_its_index_on_every_network():
    spec = lab_spec.load_spec()
    lab_a, lab_b, lab_e = spec.machine("lab-a"), spec.machine("lab-b"), spec.machine("lab-e")
    assert spec.address(lab_a, "mgmt") == "198.18.0.11"
    assert spec.address(lab_a, "wg0") == "198.18.3.11"
    assert spec.address(lab_b, "fabric") == "198.18.1.12"
    assert spec.address(lab_e, "mgmt") == "198.18.0.15"
    networks = spec.machine_json(lab_a)["networks"]
    assert [(n["interface"], n["address"]) for n in networks] == [
        ("eth0", "198.18.0.11"), ("eth1", "198.18.1.11"), ("eth2", "198.18.2.11"),
        ("wg0", "198.18.3.11")]
    assert [n["default_route"] for n in networks] == [True, False, False, False]


def test_twenty_spec_has_lab_01_to_lab_20_with_eight_h100_on_mgmt_and_fabric():
    spec = lab_spec.load_spec(lab_spec.SPEC_DIR / "twenty.toml")
    assert [m.name for m in spec.machines] == [f"lab-{i:02d}" for i in range(1, 21)]
    for machine in spec.machines:
        assert machine.arch == "x86_64"
        assert machine.networks == ("mgmt", "fabric")
        assert [(a.model, a.count) for a in machine.accelerators] == [("NVIDIA H100 80GB HBM3", 8)]
    assert spec.address(spec.machines[-1], "fabric") == "198.18.1.30"


def test_link_names_fit_in_fifteen_characters():
    for path in lab_spec.SPEC_DIR.glob("*.toml"):
        spec = lab_spec.load_spec(path)
        for machine in spec.machines:
            for network in machine.networks:
                assert len(machine.host_link(network)) <= 15
                assert len(machine.temp_link(network)) <= 15
        assert all(len(network.bridge) <= 15 for network in spec.networks)


def test_the_lab_hub_is_host_250_of_the_management_network_at_the_default_specs_rate():
    spec = lab_spec.load_spec()
    assert (spec.hub_address, spec.hub_url) == ("198.18.0.250", "http://198.18.0.250:8090")
    assert (spec.hub.rate_mbit, spec.hub.netns, spec.hub.host_link("mgmt")) == (400, "fl-hub", "flh-mgmt")
    minimal = lab_spec.parse_spec(minimal_spec())  # no [hub] table: the defaults
    assert (minimal.hub.rate_mbit, minimal.hub.port) == (lab_spec.DEFAULT_HUB_RATE_MBIT, 8090)
    shaped = lab_spec.parse_spec(minimal_spec(hub={"rate_mbit": 50, "port": 9000}))
    assert (shaped.hub.rate_mbit, shaped.hub_url) == (50, "http://198.18.0.250:9000")


def test_the_engine_s_pace_comes_from_the_spec_and_reaches_every_machine_s_agent_config():
    spec = lab_spec.load_spec()
    assert spec.engine.tokens_per_second == lab_spec.DEFAULT_ENGINE_PACE == 200
    assert lab_spec.parse_spec(minimal_spec()).engine.tokens_per_second == 200  # no [engine] table: the default
    fast = lab_spec.parse_spec(minimal_spec(engine={"tokens_per_second": 1500.5}))
    for runtime in lab_spec.RUNTIMES:
        config = lab_machine.agent_config("m-one", runtime, fast)
        # With `process` a spanning copy's engine drives Ray from the lab's Python (the image's has Ray).
        ray_python = {"FADEN_LAB_RAY_PYTHON": config["process"]["python"]} if runtime == "process" else {}
        assert config["engine_env"] == {"FADEN_LAB_ENGINE_PACE": "1500.5"} | ray_python
        assert config["process"]["vllm"] == str(LAB_STUBS / "vllm")


def test_disk_mib_makes_a_tmpfs_disk_and_its_absence_a_directory():
    spec = lab_spec.load_spec()
    assert spec.machine_json(spec.machine("lab-c"))["disk"] == {"kind": "tmpfs", "mib": 1024}
    assert spec.machine_json(spec.machine("lab-a"))["disk"] == {"kind": "directory", "mib": None}


def test_defaults_table_is_merged_into_every_machine():
    raw = minimal_spec(defaults={"arch": "aarch64"})
    spec = lab_spec.parse_spec(raw)
    assert {m.arch for m in spec.machines} == {"aarch64"}


@pytest.mark.parametrize("change, complaint", [
    ({"networks": [{"name": "mgmt", "subnet": "10.0.0.0/24", "interface": "eth0",
                    "rate_mbit": 100, "management": True}]}, "outside 198.18.0.0/15"),
    ({"networks": [{"name": "mgmt", "subnet": "198.18.0.0/24", "interface": "eth0",
                    "rate_mbit": 100}]}, "exactly one network must have management"),
    ({"machines": [{"name": "m-one", "networks": ["mgmt", "nowhere"]}]}, "no network named"),
    ({"machines": [{"name": "m-one", "networks": ["fabric"]}]}, "management network"),
    ({"machines": [{"name": "m-one", "networks": ["mgmt"]}] * 2}, "listed twice"),
    ({"machines": [{"name": "Bad_Name", "networks": ["mgmt"]}]}, "hostname"),
    ({"machines": [{"name": "m-one", "networks": ["mgmt"], "gpus": 8}]}, "unknown key"),
    ({"machines": [{"name": "m-one", "networks": ["mgmt"], "arch": "sparc"}]}, "arch"),
    ({"machines": [{"name": "m-one", "networks": ["mgmt"],
                    "accelerators": [{"vendor": "intel", "model": "X", "memory_mib": 1}]}]},
     "vendor"),
    ({"machines": [{"name": "m-one", "networks": ["mgmt"], "disk_mib": 0}]}, "disk_mib"),
    ({"hub": {"rate_mbit": 0}}, "[hub]: rate_mbit"),
    ({"hub": {"port": 70000}}, "[hub]: port 70000"),
    ({"hub": {"address": "198.18.0.2"}}, "[hub]: unknown key(s): address"),
    ({"hub": 400}, "[hub] must be a table"),
    ({"engine": {"tokens_per_second": 0}}, "[engine]: tokens_per_second must be a number of tokens per second"),
    ({"engine": {"tokens_per_second": "fast"}}, "[engine]: tokens_per_second"),
    ({"engine": {"pace": 200}}, "[engine]: unknown key(s): pace"),
    ({"engine": 200}, "[engine] must be a table"),
    ({"machines": [{"name": "hub", "networks": ["mgmt"]}]}, "the lab hub's"),
    ({"networks": [{"name": "mgmt", "subnet": "198.18.0.0/25", "interface": "eth0", "rate_mbit": 100,
                    "management": True}], "machines": [{"name": "m-one", "networks": ["mgmt"]}]}, "needs a /24"),
])
def test_spec_rejects_mistakes_with_a_reason(change, complaint):
    with pytest.raises(lab_util.LabError, match=re.escape(complaint)):
        lab_spec.parse_spec(minimal_spec(**change))


def test_spec_rejects_more_machines_than_a_subnet_holds():
    raw = minimal_spec()
    raw["networks"][1]["subnet"] = "198.18.1.0/28"  # hosts .1-.14: room for .11-.14
    raw["machines"] = [{"name": f"m{i}", "networks": ["mgmt"]} for i in range(5)]
    with pytest.raises(lab_util.LabError, match="too small"):
        lab_spec.parse_spec(raw)
    raw["machines"] = raw["machines"][:4]
    assert len(lab_spec.parse_spec(raw).machines) == 4


def test_fingerprint_is_the_one_ssh_keygen_prints(tmp_path):
    if not shutil.which("ssh-keygen"):
        pytest.skip("ssh-keygen is not installed")
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    printed = subprocess.run(["ssh-keygen", "-l", "-f", f"{key}.pub"], capture_output=True,
                             text=True, check=True).stdout.split()[1]
    assert lab_machine.fingerprint(Path(f"{key}.pub").read_text()) == printed


# --------------------------------------------------------------------------
# The command line without a lab (no root needed)


def test_up_without_root_stops_with_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FADEN_LAB_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(lab_util.os, "geteuid", lambda: 1000)
    assert lab_cli.main(["up"]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "root" in captured.err
    assert "Traceback" not in captured.err
    assert not (tmp_path / "state").exists()


def test_status_and_down_when_nothing_is_up(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FADEN_LAB_DIR", str(tmp_path / "state"))
    assert lab_cli.main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "up": False, "machines": [], "networks": [], "console_address": None}
    assert lab_cli.main(["down"]) == 0
    assert not (tmp_path / "state").exists()


def test_a_lab_whose_run_is_gone_may_be_taken_down_and_one_put_up_by_hand_may_not(tmp_path):
    from lab import core as lab_core
    gone = subprocess.Popen(["true"])
    gone.wait()
    for name, owner in (("gone", gone.pid), ("alive", lab_core.os.getpid()), ("by-hand", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.json").write_text(json.dumps({"status": "up", "owner_pid": owner}))
    assert lab_core._owner_gone(tmp_path / "gone") == gone.pid
    assert lab_core._owner_gone(tmp_path / "alive") is None
    assert lab_core._owner_gone(tmp_path / "by-hand") is None
    assert lab_core._owner_gone(tmp_path / "missing") is None


def test_unknown_command_exits_2(capsys):
    assert lab_cli.main(["sideways"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# --------------------------------------------------------------------------
# The stubs, fed a machine.json directly (no root needed)


def run_stub(tmp_path, machine: dict, *args: str) -> subprocess.CompletedProcess:
    spec_file = tmp_path / "machine.json"
    spec_file.write_text(json.dumps(machine))
    env = {"PATH": "/usr/bin:/bin", "FADEN_LAB_MACHINE_JSON": str(spec_file),
           "FADEN_LAB_GPU_STATE_JSON": str(tmp_path / "none.json")}
    return subprocess.run([sys.executable, str(LAB_STUBS / args[0]), *args[1:]],
                          capture_output=True, text=True, env=env)


def spec_of(name: str) -> dict:
    spec = lab_spec.load_spec()
    return spec.machine_json(spec.machine(name))


def test_nvidia_smi_answers_a_query_in_the_real_csv_style(tmp_path):
    fields = "index,name,memory.total,memory.used,uuid,pci.bus_id,utilization.gpu,driver_version"
    result = run_stub(tmp_path, spec_of("lab-c"), "nvidia-smi", f"--query-gpu={fields}",
                      "--format=csv,noheader,nounits")
    assert result.returncode == 0
    rows = [line.split(", ") for line in result.stdout.splitlines()]
    assert len(rows) == 4
    assert rows[0][:4] == ["0", "NVIDIA A100-SXM4-40GB", "40960", "0"]
    assert re.match(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
                    rows[0][4])
    assert re.match(r"^00000000:[0-9A-F]{2}:00\.0$", rows[0][5])
    assert rows[0][6:] == ["0", "535.183.01"]
    assert len({row[4] for row in rows}) == 4


def test_nvidia_smi_header_and_units_like_the_real_tool(tmp_path):
    result = run_stub(tmp_path, spec_of("lab-a"), "nvidia-smi",
                      "--query-gpu=name,memory.total,utilization.gpu", "--format=csv")
    lines = result.stdout.splitlines()
    assert lines[0] == "name, memory.total [MiB], utilization.gpu [%]"
    assert lines[1] == "NVIDIA H100 80GB HBM3, 81559 MiB, 0 %"
    assert len(lines) == 9


def test_nvidia_smi_refuses_an_unknown_field_with_exit_2(tmp_path):
    result = run_stub(tmp_path, spec_of("lab-a"), "nvidia-smi", "--query-gpu=name,bogus",
                      "--format=csv,noheader")
    assert result.returncode == 2
    assert result.stdout == 'Field "bogus" is not a valid field to query.\n\n'


def test_nvidia_smi_lists_gpus(tmp_path):
    result = run_stub(tmp_path, spec_of("lab-d"), "nvidia-smi", "-L")
    assert result.stdout.splitlines()[0].startswith("GPU 0: NVIDIA GH200 96GB (UUID: GPU-")
    assert len(result.stdout.splitlines()) == 4
    assert "NVIDIA-SMI" in run_stub(tmp_path, spec_of("lab-d"), "nvidia-smi").stdout


def test_rocm_smi_answers_product_and_vram_as_json(tmp_path):
    result = run_stub(tmp_path, spec_of("lab-e"), "rocm-smi", "--showproductname",
                      "--showmeminfo", "vram", "--json")
    assert result.returncode == 0
    cards = json.loads(result.stdout)
    assert sorted(cards) == [f"card{i}" for i in range(8)]
    assert cards["card0"]["Card series"] == "AMD Instinct MI300X"
    assert cards["card0"]["VRAM Total Memory (B)"] == "206158430208"
    assert int(cards["card7"]["VRAM Total Used Memory (B)"]) < 206158430208


# --------------------------------------------------------------------------
# A running lab (root)


@pytest.fixture(scope="module")
def lab(fresh_lab):
    """The test run's lab, put up anew for this module (whose last test takes it down)."""
    return fresh_lab


def reach(lab, from_address: str, to_address: str, port: int = 22) -> bool:
    """Can the machine at from_address open a TCP connection to to_address?"""
    probe = (f"/usr/bin/python3 -c 'import socket; "
             f"socket.create_connection((\"{to_address}\", {port}), 2)'")
    return lab.ssh(from_address, probe).returncode == 0


def ping(lab, from_address: str, to_address: str) -> bool:
    if not shutil.which("ping"):
        return reach(lab, from_address, to_address)
    return lab.ssh(from_address, f"ping -c 1 -W 2 {to_address}").returncode == 0


@pytest.mark.lab
class TestRunningLab:
    def test_up_took_seconds_not_minutes(self, lab):
        assert lab.up_seconds < 30

    def test_status_lists_five_machines_with_addresses_and_fingerprints(self, lab):
        status = lab.status()
        assert status["up"] is True
        assert status["console_address"] == "198.18.0.1"
        assert [(m["name"], m["address"]) for m in status["machines"]] == [
            ("lab-a", "198.18.0.11"), ("lab-b", "198.18.0.12"), ("lab-c", "198.18.0.13"),
            ("lab-d", "198.18.0.14"), ("lab-e", "198.18.0.15")]
        for machine in status["machines"]:
            assert FINGERPRINT.match(machine["host_key_fingerprint"])
            assert (machine["ssh_port"], machine["ssh_user"], machine["powered"]) == (22, "root", True)
            assert {"arch", "accelerators", "networks", "disk"} <= set(machine["spec"])
        assert len({m["host_key_fingerprint"] for m in status["machines"]}) == 5
        assert [(n["name"], n["bridge"], n["interface"]) for n in status["networks"]] == [
            ("mgmt", "flb-mgmt", "eth0"), ("fabric", "flb-fabric", "eth1"),
            ("slow", "flb-slow", "eth2"), ("wg0", "flb-wg0", "wg0")]
        assert "lab-a" in lab.run("status").stdout

    def test_up_again_says_it_is_already_up(self, lab):
        result = lab.run("up", "--authorized-key", f"{lab.key}.pub")
        assert "already up" in result.stdout

    def test_another_state_dir_can_neither_put_up_nor_take_down_this_lab(self, lab, tmp_path):
        other = {**lab.env, "FADEN_LAB_DIR": str(tmp_path / "other")}
        for command, code in ((["up"], 1), (["down"], 0)):
            result = subprocess.run([sys.executable, "-m", "lab", *command], cwd=REPO, env=other,
                                    capture_output=True, text=True, timeout=60)
            assert result.returncode == code
            assert str(lab.state_dir) in result.stdout + result.stderr
        assert all(m["powered"] for m in lab.status()["machines"])
        assert lab.ssh("198.18.0.11", "hostname").stdout.strip() == "lab-a"

    def test_ssh_into_lab_a_shows_its_hostname_gpus_and_arch(self, lab):
        result = lab.ssh("198.18.0.11", "hostname; nvidia-smi --query-gpu=name,memory.total "
                                        "--format=csv,noheader,nounits; uname -m")
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == (
            ["lab-a"] + ["NVIDIA H100 80GB HBM3, 81559"] * 8 + ["x86_64"])

    def test_lab_d_says_aarch64_and_lab_e_answers_rocm_smi(self, lab):
        result = lab.ssh("198.18.0.14", "hostname; uname -m; nvidia-smi -L | wc -l")
        assert result.stdout.split() == ["lab-d", "aarch64", "4"]
        result = lab.ssh("198.18.0.15", "rocm-smi --showproductname --showmeminfo vram --json; "
                                        "command -v nvidia-smi || echo no-nvidia-smi")
        cards, missing = result.stdout.splitlines()
        assert json.loads(cards)["card3"]["Card series"] == "AMD Instinct MI300X"
        assert missing == "no-nvidia-smi"

    def test_each_machine_has_its_own_files_and_store(self, lab):
        result = lab.ssh("198.18.0.13", "cat /etc/fadenstack/agent.json; "
                                        "df -m --output=size /var/lib/fadenstack | tail -1; "
                                        "touch /tmp/only-on-lab-c; ls /opt/fadenstack")
        lines = result.stdout.splitlines()
        config = json.loads("".join(lines[:-2]))
        assert config["machine_name"] == "lab-c" and config["runtime_driver"] == "process"  # the tests' fast path
        assert int(lines[-2]) == 1024  # lab-c's disk_mib
        assert lines[-1] == "autostart.d"
        assert lab.ssh("198.18.0.12", "ls /tmp/only-on-lab-c").returncode != 0
        assert not Path("/tmp/only-on-lab-c").exists()

    def test_lab_a_reaches_lab_b_on_fabric_and_lab_e_is_not_on_fabric(self, lab):
        assert ping(lab, "198.18.0.11", "198.18.1.12")
        addresses = lab.ssh("198.18.0.15", "ip -o -4 addr show").stdout
        assert "198.18.1." not in addresses
        assert "198.18.0.15/24" in addresses
        assert not reach(lab, "198.18.0.11", "198.18.1.15")

    def test_machines_route_only_to_the_host_which_forwards_nothing(self, lab):
        route = lab.ssh("198.18.0.11", "ip route show default").stdout
        assert route.split()[:5] == ["default", "via", "198.18.0.1", "dev", "eth0"]
        for bridge in ("flb-mgmt", "flb-fabric", "flb-slow", "flb-wg0"):
            assert Path(f"/proc/sys/net/ipv4/conf/{bridge}/forwarding").read_text().strip() == "0"

    def test_links_are_shaped_to_the_spec_rates(self, lab):
        host_side = subprocess.run(["tc", "qdisc", "show", "dev", "fl1-fabric"],
                                   capture_output=True, text=True).stdout
        machine_side = subprocess.run(["tc", "-n", "fl-lab-a", "qdisc", "show", "dev", "eth2"],
                                      capture_output=True, text=True).stdout
        assert "tbf" in host_side and "rate 400Mbit" in host_side
        assert "tbf" in machine_side and "rate 40Mbit" in machine_side

    def test_swapped_host_key_shows_a_new_fingerprint(self, lab):
        before = lab.machine("lab-a")["host_key_fingerprint"]
        lab.run("fault", "lab-a", "swap-host-key")
        after = lab.machine("lab-a")["host_key_fingerprint"]
        assert FINGERPRINT.match(after) and after != before
        scanned = subprocess.run("ssh-keyscan -t ed25519 198.18.0.11 2>/dev/null | ssh-keygen -lf -",
                                 shell=True, capture_output=True, text=True).stdout
        assert after in scanned

    def test_power_off_stops_ssh_and_power_on_reruns_autostart(self, lab):
        install = ("mkdir -p /opt/fadenstack/autostart.d && "
                   "printf '#!/bin/sh\\necho booted >> /var/lib/fadenstack/boots\\n"
                   "exec sleep 600\\n' > /opt/fadenstack/autostart.d/10-heartbeat && "
                   "chmod +x /opt/fadenstack/autostart.d/10-heartbeat")
        assert lab.ssh("198.18.0.12", install).returncode == 0
        lab.run("fault", "lab-b", "power-off")
        assert lab.machine("lab-b")["powered"] is False
        assert lab.ssh("198.18.0.12", "true", connect_timeout=2).returncode != 0
        assert not subprocess.run(["ip", "netns", "pids", "fl-lab-b"], capture_output=True,
                                  text=True).stdout.strip()
        lab.run("fault", "lab-b", "power-on")
        try:
            assert lab.machine("lab-b")["powered"] is True
            result = lab.ssh("198.18.0.12", "cat /var/lib/fadenstack/boots; pgrep -x sleep -a; "
                                            "cat /opt/fadenstack/autostart.log")
            assert result.returncode == 0, result.stderr
            assert result.stdout.splitlines()[0] == "booted"
            assert "sleep 600" in result.stdout
            assert "10-heartbeat" in result.stdout
            assert ping(lab, "198.18.0.11", "198.18.1.12")  # its links came back too
        finally:  # the machine as it was: no boot hook of ours, no sleeper
            lab.ssh("198.18.0.12", "rm -f /opt/fadenstack/autostart.d/10-heartbeat /var/lib/fadenstack/boots")
            lab.run("fault", "lab-b", "kill-process", "sleep 600")

    def test_link_down_cuts_one_network_and_link_up_restores_it(self, lab):
        lab.run("fault", "lab-c", "link-down", "fabric")
        assert not reach(lab, "198.18.0.11", "198.18.1.13")
        assert reach(lab, "198.18.0.11", "198.18.3.13")  # wg0 still up
        assert "NO-CARRIER" in lab.ssh("198.18.0.13", "ip link show eth1").stdout
        lab.run("fault", "lab-c", "link-up", "fabric")
        assert reach(lab, "198.18.0.11", "198.18.1.13")

    def test_sshd_stop_refuses_connections_until_sshd_start(self, lab):
        lab.run("fault", "lab-d", "sshd-stop")
        assert lab.machine("lab-d")["sshd_running"] is False
        assert lab.ssh("198.18.0.14", "true", connect_timeout=2).returncode != 0
        lab.run("fault", "lab-d", "sshd-start")
        assert lab.ssh("198.18.0.14", "hostname").stdout.strip() == "lab-d"

    def test_port_taken_listens_on_every_address_until_freed(self, lab):
        lab.run("fault", "lab-c", "port-taken", "8265")
        assert lab.machine("lab-c")["faults"]["ports_taken"] == [8265]
        assert reach(lab, "198.18.0.11", "198.18.0.13", 8265)
        assert reach(lab, "198.18.0.11", "198.18.1.13", 8265)
        busy = lab.ssh("198.18.0.13", "/usr/bin/python3 -c 'import socket; "
                                      "socket.socket().bind((\"198.18.1.13\", 8265))'")
        assert "Address already in use" in busy.stderr
        lab.run("fault", "lab-c", "port-free", "8265")
        assert not reach(lab, "198.18.0.11", "198.18.0.13", 8265)

    def test_disk_full_leaves_no_room_until_disk_free(self, lab):
        lab.run("fault", "lab-c", "disk-full")
        full = lab.ssh("198.18.0.13", "echo data > /var/lib/fadenstack/probe")
        assert full.returncode != 0 and "No space left" in full.stderr
        lab.run("fault", "lab-c", "disk-free")
        assert lab.ssh("198.18.0.13", "echo data > /var/lib/fadenstack/probe").returncode == 0

    def test_link_slow_reshapes_both_ends(self, lab):
        lab.run("fault", "lab-a", "link-slow", "fabric", "25")
        assert "rate 25Mbit" in subprocess.run(["tc", "qdisc", "show", "dev", "fl1-fabric"],
                                               capture_output=True, text=True).stdout
        assert "rate 25Mbit" in subprocess.run(["tc", "-n", "fl-lab-a", "qdisc", "show", "dev",
                                                "eth1"], capture_output=True, text=True).stdout
        assert lab.machine("lab-a")["faults"]["link_rates"] == {"fabric": 25}
        lab.run("fault", "lab-a", "link-restore", "fabric")
        assert "rate 400Mbit" in subprocess.run(["tc", "qdisc", "show", "dev", "fl1-fabric"],
                                                capture_output=True, text=True).stdout

    @pytest.mark.parametrize("args", [
        ("lab-z", "power-off"), ("lab-a", "explode"), ("lab-e", "link-down", "fabric"),
        ("lab-a", "link-slow", "fabric"), ("lab-a", "disk-full"),
    ])
    def test_unknown_machine_kind_or_network_exits_2_with_one_line(self, lab, args):
        result = lab.run("fault", *args, check=False)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1

    def test_down_leaves_no_namespace_link_process_or_mount(self, lab):
        # Leave the lab busy: an open SSH session and a taken port.
        session = subprocess.Popen(
            ["ssh", "-i", str(lab.key), "-o", "StrictHostKeyChecking=no",
             "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
             "root@198.18.0.11", "sleep 300"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        hub = lab.status()["hub"]
        assert hub["running"] and lab_machine.pid_alive(hub["pid"])
        try:
            lab.run("fault", "lab-a", "port-taken", "9000")
            time.sleep(0.5)
            started = time.monotonic()
            assert "lab is down" in lab.run("down").stdout
            assert time.monotonic() - started < 20
            assert session.wait(timeout=20) is not None
        finally:
            if session.poll() is None:
                session.kill()
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "fl-" not in namespaces and "fl-hub" not in namespaces
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert not re.search(r"^\d+: (flb-|fl\d+-|fm\d+-|flh-|fmh-)", links, re.MULTILINE)
        processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert not lab_machine.pid_alive(hub["pid"])  # the lab hub (a zombie until init reaps it is dead)
        assert not re.search(r"-m lab hub .*--token-file", processes)
        for trace in (str(lab.state_dir), "/run/fadenstack-lab", "fadenstack-lab-port-taken"):
            assert trace not in processes
        mounts = Path("/proc/self/mountinfo").read_text()
        for trace in (str(lab.state_dir), "fadenstack-lab", "/run/netns/fl-"):
            assert trace not in mounts
        assert not (lab.state_dir / "state.json").exists()
        assert lab.status() == {"up": False, "machines": [], "networks": [],
                                "console_address": None}
        assert "not up" in lab.run("down").stdout
