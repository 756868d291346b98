"""The cluster's firewall on a machine (agent firewall.py): the spec's checks and the ruleset's text.

The text is also given to ``nft --check`` when the host has nft and may use it (nothing is applied)."""

import json
import os
import shutil
import subprocess

import pytest

from fadenstack_agent import firewall, ports
from fadenstack_agent.__main__ import main
from fadenstack_agent.protocol import BAD_INPUT, AgentError

SPEC = {"members": ["198.18.1.11", "198.18.1.12", "fd00::5"], "console": ["198.18.0.1"],
        "gateway": ["198.18.1.1"], "ports": {"gcs": 6379, "copies": [8100, 8199], "files": 7470}}


def spec(**changes):
    out = json.loads(json.dumps(SPEC))
    out.update(changes)
    return out


def refused(raw) -> str:
    with pytest.raises(AgentError) as caught:
        firewall.parse_spec(raw)
    assert caught.value.kind == BAD_INPUT
    return str(caught.value)


def test_the_table_is_named_after_the_cluster_and_bad_names_are_refused():
    assert firewall.table_name("gpu-room") == "fadenstack_gpu_room"
    for bad in ("", "GPU", "-a", "a-", "a b", "a;b", "a_b", "a" * 64, "room\n"):
        with pytest.raises(AgentError) as caught:
            firewall.table_name(bad)
        assert caught.value.kind == BAD_INPUT and "cluster's name" in str(caught.value)


def test_ray_ports_are_the_pinned_ones_merged_into_ranges():
    ranges = firewall.ray_ports(ports.GCS)
    covered = {p for low, high in ranges for p in range(low, high + 1)}
    assert set(ports.RAY_SINGLE) | set(ports.HEAD_METRICS) <= covered
    for low, high in ports.RAY_RANGES:
        assert set(range(low, high + 1)) <= covered
    assert firewall.ray_ports(7000)[0] == (6379, 6387) and (7000, 7000) in firewall.ray_ports(7000)
    assert firewall.merge_ranges([(5, 9), (1, 2), (3, 3), (8, 12), (20, 20)]) == [(1, 3), (5, 12), (20, 20)]


def test_the_ruleset_lets_each_port_set_in_from_its_own_addresses_only():
    text = firewall.table_text("gpu-room", firewall.parse_spec(SPEC))
    lines = [line.strip() for line in text.splitlines()]
    assert lines[0] == "table inet fadenstack_gpu_room {"
    assert "type filter hook input priority filter; policy accept;" in lines
    # loopback and established first, before any drop
    first_drop = next(i for i, line in enumerate(lines) if line.endswith("drop"))
    assert lines.index('iifname "lo" accept') < first_drop
    assert lines.index("ct state established,related accept") < first_drop
    ray = "meta l4proto { tcp, udp } th dport { 6379-6387, 10001-10199, 20000-20999 }"
    assert f"{ray} ip saddr @ray_from_v4 accept" in lines and f"{ray} drop" in lines
    assert "meta l4proto { tcp, udp } th dport { 8100-8199 } drop" in lines
    assert "meta l4proto { tcp, udp } th dport { 7470 } drop" in lines
    sets = text.split("\tset ")[1:]
    elements = {part.split(" ", 1)[0]: part.split("elements = { ")[1].split(" }")[0] if "elements" in part else ""
                for part in sets}
    assert elements["ray_from_v4"] == "198.18.1.11, 198.18.1.12"           # members only
    assert elements["copies_from_v4"] == "198.18.0.1, 198.18.1.1, 198.18.1.11, 198.18.1.12"  # + console, gateway
    assert elements["files_from_v4"] == "198.18.0.1, 198.18.1.11, 198.18.1.12"  # + console
    assert elements["ray_from_v6"] == elements["files_from_v6"] == "fd00::5"
    assert "22" not in {w.strip("{},;") for w in text.split()}  # SSH is not named: untouched


def test_an_empty_address_family_has_a_set_without_elements_and_overlaps_are_collapsed():
    text = firewall.table_text("a", firewall.parse_spec(spec(members=["10.0.0.5"], console=["10.0.0.0/24"],
                                                             gateway=[])))
    assert "set ray_from_v6 {\n\t\ttype ipv6_addr\n\t\tflags interval\n\t}" in text
    assert "elements = { 10.0.0.0/24 }" in text  # 10.0.0.5 lies in the console's network: one element


def test_a_rewrite_deletes_and_makes_the_table_in_one_transaction_with_other_clusters_tables():
    text = firewall.replace_text("b", firewall.parse_spec(SPEC), others=["fadenstack_a"])
    head = [line for line in text.splitlines() if line and not line.startswith("#")][:4]
    assert head == ["table inet fadenstack_b", "delete table inet fadenstack_b",
                    "table inet fadenstack_a", "delete table inet fadenstack_a"]
    assert firewall.remove_text(["fadenstack_b"]) == "table inet fadenstack_b\ndelete table inet fadenstack_b\n"


@pytest.mark.parametrize("raw, words", [
    (b"not json", "not JSON"),
    (b"[]", "one JSON object"),
    (spec(extra=1), "unknown key"),
    (spec(members=[]), "'members' must be a list of addresses with at least one"),
    (spec(members="198.18.1.11"), "'members' must be a list"),
    (spec(members=["198.18.1.300"]), "neither an IP address nor a network"),
    (spec(members=["node-0"]), "neither an IP address"),
    (spec(members=["198.18.1.11; flush ruleset"]), "neither an IP address"),
    (spec(console=["10.0.0.1/24"]), "neither an IP address nor a network"),  # host bits set
    (spec(console=["0.0.0.0/0"]), "every address"),
    (spec(gateway=["::/0"]), "every address"),
    (spec(gateway=[5]), "addresses as text"),
    (spec(ports={"gcs": 6379, "copies": [8100, 8199]}), "'ports' must be"),
    (spec(ports={"gcs": 0, "copies": [8100, 8199], "files": 7470}), "ports.gcs must be a TCP port"),
    (spec(ports={"gcs": True, "copies": [8100, 8199], "files": 7470}), "ports.gcs must be a TCP port"),
    (spec(ports={"gcs": 6379, "copies": [8199, 8100], "files": 7470}), "down to"),
    (spec(ports={"gcs": 6379, "copies": "8100-8199", "files": 7470}), "[LOW, HIGH]"),
    (spec(ports={"gcs": 6379, "copies": [8100, 8199], "files": 8150}), "share 8150"),
    (spec(ports={"gcs": 6379, "copies": [10000, 10100], "files": 7470}), "share 10001-10100"),
    (spec(members=["10.0.0.%d" % (i % 250) for i in range(5000)]), "more than"),
])
def test_bad_specs_are_refused_naming_the_part(raw, words):
    message = refused(raw if isinstance(raw, bytes) else json.dumps(raw).encode())
    assert words in message, message


def _run(argv, stdin: bytes, monkeypatch, capsys) -> tuple:
    read, write = os.pipe()
    os.write(write, stdin)
    os.close(write)
    monkeypatch.setattr(firewall, "read_spec", lambda noun: os.read(read, 1 << 20))
    code = main(argv)
    os.close(read)
    return code, [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_write_sends_nft_the_whole_transaction_without_a_shell(monkeypatch, capsys):
    calls = []

    def fake_nft(args, stdin=""):
        calls.append((args, stdin))
        return "table inet fadenstack_old\ntable inet other\n" if args[:2] == ["list", "tables"] else ""

    monkeypatch.setattr(firewall, "nft", fake_nft)
    code, lines = _run(["firewall", "write", "--cluster", "gpu-room"], json.dumps(SPEC).encode(), monkeypatch, capsys)
    assert code == 0, lines
    assert lines[-1]["replaced"] == ["fadenstack_old"] and lines[-1]["table"] == "inet fadenstack_gpu_room"
    assert lines[-1]["allowed"]["ray"] == ["198.18.1.11", "198.18.1.12", "fd00::5"]
    args, text = calls[-1]
    assert args == ["-f", "-"] and "delete table inet fadenstack_old" in text and "other" not in text


def test_write_with_a_bad_spec_changes_nothing(monkeypatch, capsys):
    monkeypatch.setattr(firewall, "nft", lambda args, stdin="": pytest.fail("nft must not run"))
    code, lines = _run(["firewall", "write", "--cluster", "gpu-room"], b'{"members": ["x"]}', monkeypatch, capsys)
    assert code == 2 and lines[-1]["kind"] == BAD_INPUT
    code, lines = _run(["firewall", "remove", "--cluster", "Gpu Room"], b"", monkeypatch, capsys)
    assert code == 2 and "cluster's name" in lines[-1]["message"]


def test_no_nft_on_the_machine_is_said_in_words(monkeypatch):
    monkeypatch.setattr(firewall.shutil, "which", lambda name: None)
    monkeypatch.setattr(firewall, "NFT_PLACES", ())
    with pytest.raises(AgentError) as caught:
        firewall.nft(["list", "tables"])
    assert caught.value.kind == "not_retryable" and "install the nftables package" in str(caught.value)


@pytest.mark.skipif(not shutil.which("nft") or os.geteuid() != 0, reason="needs nft and root to check a ruleset")
def test_nft_accepts_the_ruleset_text():
    text = firewall.replace_text("gpu-room", firewall.parse_spec(SPEC), others=["fadenstack_old"])
    done = subprocess.run(["unshare", "--net", "nft", "--check", "-f", "-"], input=text.encode(), capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


