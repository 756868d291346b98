"""A member's node files spec (clusters/node_files.py): built from connection_texts.py's texts, sshd's
drop-in and the cluster's own node key, accepted by the agent's own check, and the node key sealed
at rest."""
import base64
import hashlib
import json
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import load_ssh_private_key

from clusters import connection_texts
from clusters.connection_texts import Node, NotConnectable
from clusters.models import Cluster
from clusters.node_files import (
    NodeFilesError,
    host_key_line,
    node_files_spec,
    node_files_specs,
    node_key_for,
    node_key_forget,
    node_key_make,
    node_key_secret_name,
)
from console import secrets
from console.models import SealedSecret
from machines import remote, sshd
from machines.agent_client import Agent
from machines.models import Machine
from tests.builders import cluster_of, gpu_machine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "agent"))
from fadenstack_agent import nodespec  # noqa: E402 - the agent's own check, read from agent/ as machines run it
from fadenstack_agent.protocol import AgentError  # noqa: E402

NODE_KEY = node_key_make(comment="fadenstack-cluster-gpu-room")
CA_KEY = node_key_make(comment="fadenstack-ssh-ca").public_key
HOST_KEY = node_key_make(comment="root@lab-b").public_key


def fingerprint(line: str) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(line.split()[1])).digest()).decode().rstrip("=")


def three_nodes():
    """lab-a leads (eth1, 8 GPUs); lab-b calls its interface ens5; lab-c has no GPUs and SSH on 2222."""
    return [
        Node(rank=0, machine="lab-a", address="198.18.1.11", interface="eth1", gpus=8, vendor="nvidia"),
        Node(rank=1, machine="lab-b", address="198.18.1.12", interface="ens5", gpus=4, vendor="nvidia"),
        Node(rank=2, machine="lab-c", address="198.18.1.13", interface="eth1", gpus=0, ssh_port=2222),
    ]


def spec_for(node_index=1, **overrides):
    nodes = three_nodes()
    arguments = {"cluster": "gpu-room", "network": "198.18.1.7/24", "nodes": nodes, "node": nodes[node_index],
                 "node_key": NODE_KEY, "ca_public_key": CA_KEY + "\n",
                 "principals": sshd.root_principals(machine_id=12, cluster_id=3),
                 "host_keys": {"lab-b": [HOST_KEY.rsplit(" ", 1)[0]]}, **overrides}
    return node_files_spec(**arguments)


def test_the_spec_carries_connections_texts_for_that_node():
    nodes = three_nodes()
    spec = spec_for()

    assert spec["hostfile"] == connection_texts.hostfile(nodes) == "198.18.1.11 slots=8\n198.18.1.12 slots=4\n"
    assert spec["cluster_env"] == connection_texts.cluster_env(nodes, nodes[1])
    assert "NODE_RANK=1\n" in spec["cluster_env"] and "NCCL_SOCKET_IFNAME==ens5\n" in spec["cluster_env"]
    assert spec["hosts"] == connection_texts.hosts_lines(nodes)


def test_the_spec_carries_the_node_key_the_subnet_and_every_node_with_its_port_and_host_keys():
    ssh = spec_for()["ssh"]

    assert (ssh["private_key"], ssh["public_key"]) == (NODE_KEY.private_key, NODE_KEY.public_key)
    assert ssh["allow_from"] == "198.18.1.0/24"
    assert [(n["name"], n["address"], n["port"]) for n in ssh["nodes"]] == [
        ("node-0", "198.18.1.11", 22), ("node-1", "198.18.1.12", 22), ("node-2", "198.18.1.13", 2222)]
    assert [len(n["host_keys"]) for n in ssh["nodes"]] == [0, 1, 0]


def test_the_spec_carries_sshds_dropin_the_authority_and_roots_principals():
    spec = spec_for()["sshd"]

    assert spec["dropin"] == sshd.sshd_dropin()
    assert spec["ca_public_key"] == CA_KEY
    assert spec["principals"] == "fadenstack-cluster-3\nfadenstack-cluster-3-machine-12\n"


@pytest.mark.parametrize("node_index", [0, 1, 2])
def test_the_agent_accepts_every_members_spec(node_index):
    checked = nodespec.check_spec(spec_for(node_index))

    assert checked["ssh"]["public_key"] == NODE_KEY.public_key
    assert nodespec.strict_checking(checked["ssh"]["nodes"]) == "accept-new"  # two nodes came without host keys


def test_with_every_host_key_the_agent_checks_host_keys_strictly():
    keys = {name: [node_key_make(comment="x").public_key] for name in ("lab-a", "lab-b", "lab-c")}
    checked = nodespec.check_spec(spec_for(host_keys=keys))

    assert nodespec.strict_checking(checked["ssh"]["nodes"]) == "yes"


def test_the_agent_refuses_a_spec_whose_private_key_is_not_the_public_keys_half():
    other = node_key_make(comment="other")
    with pytest.raises(AgentError, match="not the private half"):
        nodespec.check_spec(spec_for(node_key=type(NODE_KEY)(public_key=other.public_key, private_key=NODE_KEY.private_key)))


def test_a_principal_sshd_would_misread_is_refused_in_words():
    with pytest.raises(NodeFilesError, match="principal"):
        spec_for(principals=["two words"])


def test_a_cluster_without_a_subnet_is_refused_in_words():
    with pytest.raises(NotConnectable, match="not a subnet"):
        spec_for(network="gpu-room")


def test_the_node_key_is_an_ed25519_pair_without_a_passphrase_whose_halves_match():
    key = load_ssh_private_key(NODE_KEY.private_key.encode(), password=None)
    public = key.public_key().public_bytes_raw()

    assert NODE_KEY.public_key.startswith("ssh-ed25519 ") and NODE_KEY.public_key.endswith(" fadenstack-cluster-gpu-room")
    assert base64.b64decode(NODE_KEY.public_key.split()[1]).endswith(public)
    assert NODE_KEY.private_key not in repr(NODE_KEY)


def test_a_host_key_matching_the_pin_is_kept_without_its_comment():
    assert host_key_line(HOST_KEY, machine="lab-b", pinned=fingerprint(HOST_KEY)) == " ".join(HOST_KEY.split()[:2])


@pytest.mark.parametrize(("line", "pinned", "words"), [
    (HOST_KEY, fingerprint(CA_KEY), "is not the one the console pinned"),
    (HOST_KEY, "", "none yet"),
    ("ssh-ed25519 not-base64!", "SHA256:x", "not an OpenSSH public key line"),
    ("ssh-dss AAAAB3NzaC1kc3MAAACBAP", "SHA256:x", "not an OpenSSH public key line"),
], ids=["another-key", "no-pin", "not-base64", "dss"])  # ids: the keys are made at import, differently in each worker
def test_a_host_key_that_is_not_the_pinned_one_is_refused(line, pinned, words):
    with pytest.raises(NodeFilesError, match=words):
        host_key_line(line, machine="lab-b", pinned=pinned)


# ------------------------------------------------------------------ the agent client


def test_the_spec_goes_to_the_agent_on_stdin_and_never_on_its_command_line(monkeypatch):
    sent = {}

    def run_agent(conn, argv, *, stdin=None, timeout=None, on_event=None, abort=None):
        sent.update(argv=list(argv), stdin=stdin)
        return {"event": "result", "cluster": "gpu-room", "changed": True, "paths": ["/etc/hosts"],
                "sshd": {"config": "/etc/ssh/sshd_config", "include_added": True, "checked": True,
                         "reloaded": "SIGHUP to sshd (pid 812)"}, "warnings": ["a sentence"]}

    monkeypatch.setattr(remote, "run_agent", run_agent)
    agent = Agent(Machine(name="lab-b", python_path="/usr/bin/python3", agent_path="/opt/fadenstack/agent/a.pyz"), conn=None)

    change = agent.node_files_write(spec_for())

    assert sent["argv"] == ["/usr/bin/python3", "/opt/fadenstack/agent/a.pyz", "node", "files", "write"]
    assert json.loads(sent["stdin"])["ssh"]["private_key"] == NODE_KEY.private_key
    assert not any("PRIVATE" in word for word in sent["argv"])
    assert (change.changed, change.paths, change.sshd_reloaded, change.include_added, change.warnings) == (
        True, ("/etc/hosts",), "SIGHUP to sshd (pid 812)", True, ("a sentence",))
    agent.node_files_remove()
    assert sent["argv"][-3:] == ["node", "files", "remove"] and sent["stdin"] is None


def test_the_host_key_is_the_one_this_connection_received():
    class Key:
        def get_name(self):
            return "ssh-ed25519"

        def get_base64(self):
            return HOST_KEY.split()[1]

    class Transport:
        def get_remote_server_key(self):
            return Key()

    conn = type("Conn", (), {"client": type("Client", (), {"get_transport": lambda self: Transport()})()})()
    agent = Agent(Machine(name="lab-b"), conn=conn)

    assert agent.host_key() == " ".join(HOST_KEY.split()[:2])


# ------------------------------------------------------------------ from the database


@pytest.fixture
def sealed(settings, tmp_path):
    settings.FADEN_SECRETS_KEY_PATH = tmp_path / "keys" / "secrets.key"
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "ssh" / "ca_ed25519"


@pytest.mark.django_db
def test_the_cluster_node_key_is_made_once_and_sealed_at_rest(sealed):
    cluster = cluster_of([gpu_machine("lab-a", 11)])

    first = node_key_for(cluster=cluster)
    again = node_key_for(cluster=Cluster.objects.get(pk=cluster.pk))

    assert again == first and again.private_key == first.private_key
    assert Cluster.objects.get(pk=cluster.pk).node_public_key == first.public_key
    stored = SealedSecret.objects.get(name=node_key_secret_name(cluster.pk)).sealed
    assert "PRIVATE KEY" not in stored and first.private_key.splitlines()[1] not in stored


@pytest.mark.django_db
def test_a_node_key_that_cannot_be_unsealed_is_replaced_by_a_new_pair(sealed):
    cluster = cluster_of([gpu_machine("lab-a", 11)])
    first = node_key_for(cluster=cluster)
    secrets.secret_clear(node_key_secret_name(cluster.pk))

    second = node_key_for(cluster=cluster)

    assert second.public_key != first.public_key
    assert Cluster.objects.get(pk=cluster.pk).node_public_key == second.public_key
    assert secrets.secret_get(node_key_secret_name(cluster.pk)) == second.private_key


@pytest.mark.django_db
def test_forgetting_the_node_key_removes_its_sealed_secret(sealed):
    cluster = cluster_of([gpu_machine("lab-a", 11)])
    node_key_for(cluster=cluster)

    assert node_key_forget(cluster=cluster) is True
    assert not SealedSecret.objects.filter(name=node_key_secret_name(cluster.pk)).exists()
    assert node_key_forget(cluster=cluster) is False


@pytest.mark.django_db
def test_every_members_spec_from_the_database_names_its_own_principal_and_the_pinned_host_keys(sealed):
    head, worker = gpu_machine("lab-a", 11), gpu_machine("lab-b", 12, accelerators=2)
    head.host_key_fingerprint = fingerprint(HOST_KEY)
    head.save(update_fields=["host_key_fingerprint"])
    cluster = cluster_of([head, worker])

    specs = node_files_specs(cluster, host_keys={"lab-a": HOST_KEY})

    assert sorted(specs) == ["lab-a", "lab-b"]
    assert specs["lab-b"]["sshd"]["principals"] == f"fadenstack-cluster-{cluster.pk}\nfadenstack-cluster-{cluster.pk}-machine-{worker.pk}\n"
    assert [n["host_keys"] for n in specs["lab-b"]["ssh"]["nodes"]] == [[" ".join(HOST_KEY.split()[:2])], []]
    assert specs["lab-a"]["ssh"]["public_key"] == Cluster.objects.get(pk=cluster.pk).node_public_key
    for spec in specs.values():
        nodespec.check_spec(spec)


@pytest.mark.django_db
def test_a_member_offering_another_host_key_than_its_pin_stops_the_specs(sealed):
    cluster = cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])

    with pytest.raises(NodeFilesError, match="lab-b's host key"):
        node_files_specs(cluster, host_keys={"lab-b": HOST_KEY})
