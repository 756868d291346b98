"""The Connect card's plain data: nodes from a cluster's members, the hostfile, each node's
cluster.env, /etc/hosts and the launcher commands (clusters/connection_texts.py)."""
import shlex
import subprocess

import pytest

from clusters.choices import Role
from clusters.connection_texts import (
    ClusterNet,
    Node,
    NotConnectable,
    cluster_env,
    hostfile,
    hosts_lines,
    nodes_of,
    snippets,
    ssh_command,
    torchrun_node,
)
from clusters.models import ClusterMember
from tests.builders import cluster_of, gpu_machine
from tests.factories import NetworkInterfaceFactory


def two_nodes(**second):
    """lab-a leads with eth1 and 8 GPUs; lab-b names its interface on the same network ens5."""
    head = Node(rank=0, machine="lab-a", address="198.18.1.11", interface="eth1", gpus=8, vendor="nvidia",
                ssh_address="198.18.0.11")
    worker = Node(**{"rank": 1, "machine": "lab-b", "address": "198.18.1.12", "interface": "ens5", "gpus": 4,
                     "vendor": "nvidia", "ssh_address": "198.18.0.12", **second})
    return [head, worker]


NET = ClusterNet(name="gpu-room", network="198.18.1.0/24", head_address="198.18.1.11")


def env_of(text):
    """cluster.env as a shell reads it: the values after quoting."""
    out = subprocess.run(["bash", "-c", "set -a; . /dev/stdin; set +a; env -0"], input=text, capture_output=True,
                         text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


# ------------------------------------------------------------------ from the database


@pytest.mark.django_db
def test_nodes_of_numbers_the_head_zero_then_workers_by_name_with_each_machines_own_interface():
    head = gpu_machine("lab-c", 13)
    alpha = gpu_machine("lab-a", 11, accelerators=4, vendor="amd", model="AMD Instinct MI300X", cluster_network=False)
    NetworkInterfaceFactory(machine=alpha, name="enp65s0f1", addresses=["198.18.1.11/24", "fe80::11/64"])
    beta = gpu_machine("lab-b", 12, accelerators=2)
    cluster = cluster_of([head, beta, alpha])  # the first machine leads

    nodes = nodes_of(cluster)

    assert [(n.rank, n.name, n.machine) for n in nodes] == [(0, "node-0", "lab-c"), (1, "node-1", "lab-a"), (2, "node-2", "lab-b")]
    assert [n.interface for n in nodes] == ["eth1", "enp65s0f1", "eth1"]
    assert [n.address for n in nodes] == ["198.18.1.13", "198.18.1.11", "198.18.1.12"]
    assert [(n.gpus, n.vendor) for n in nodes] == [(8, "nvidia"), (4, "amd"), (2, "nvidia")]
    assert [n.ssh_address for n in nodes] == ["198.18.0.13", "198.18.0.11", "198.18.0.12"]
    assert hostfile(nodes) == "198.18.1.13 slots=8\n198.18.1.11 slots=4\n198.18.1.12 slots=2\n"


@pytest.mark.django_db
def test_nodes_of_finds_the_interface_by_the_cluster_network_when_the_address_is_not_reported_yet():
    head = gpu_machine("lab-a", 11)
    other = gpu_machine("lab-b", 12, cluster_network=False)
    NetworkInterfaceFactory(machine=other, name="ib0", addresses=["198.18.1.99/24"])
    cluster = cluster_of([head, other])
    assert [n.interface for n in nodes_of(cluster)] == ["eth1", "ib0"]


@pytest.mark.django_db
def test_nodes_of_refuses_a_member_with_no_interface_on_the_cluster_network_and_names_it():
    cluster = cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12, cluster_network=False)])
    with pytest.raises(NotConnectable, match="lab-b has no interface with 198.18.1.12"):
        nodes_of(cluster)


@pytest.mark.django_db
def test_nodes_of_refuses_a_cluster_without_its_one_head():
    cluster = cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])
    ClusterMember.objects.filter(cluster=cluster).update(role=Role.WORKER)
    with pytest.raises(NotConnectable, match="0 heads"):
        nodes_of(cluster)


@pytest.mark.django_db
def test_nodes_of_reads_a_cluster_in_a_fixed_number_of_queries(django_assert_max_num_queries):
    cluster = cluster_of([gpu_machine(f"lab-{i}", 11 + i) for i in range(6)])
    with django_assert_max_num_queries(4):  # members, interfaces, accelerators, the GPUs copies hold
        assert len(nodes_of(cluster)) == 6


# ------------------------------------------------------------------ files


def test_hostfile_has_one_line_per_node_with_its_gpus_head_first_whatever_order_it_is_given():
    nodes = two_nodes()
    assert hostfile(list(reversed(nodes))) == "198.18.1.11 slots=8\n198.18.1.12 slots=4\n"


def test_hostfile_leaves_out_a_node_without_gpus():
    assert hostfile(two_nodes(gpus=0)) == "198.18.1.11 slots=8\n"


def test_hostfile_lines_match_what_deepspeed_and_open_mpi_parse():
    import re
    for line in hostfile(two_nodes()).splitlines():
        assert re.fullmatch(r"(\S+)\s+slots=(\d+)", line)  # DeepSpeed's runner; Open MPI reads the same form


def test_cluster_env_gives_each_node_its_own_interface_and_rank_and_the_heads_address():
    nodes = two_nodes()
    head_env, worker_env = (env_of(cluster_env(nodes, node)) for node in nodes)
    assert {k: worker_env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_NODES", "GPUS_PER_NODE",
                                        "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")} == {
        "MASTER_ADDR": "198.18.1.11", "MASTER_PORT": "29500", "NODE_RANK": "1", "WORLD_NODES": "2",
        "GPUS_PER_NODE": "4", "NCCL_SOCKET_IFNAME": "=ens5", "GLOO_SOCKET_IFNAME": "ens5",
    }
    assert (head_env["NODE_RANK"], head_env["GPUS_PER_NODE"], head_env["NCCL_SOCKET_IFNAME"], head_env["GLOO_SOCKET_IFNAME"]) == (
        "0", "8", "=eth1", "eth1")


def test_cluster_env_quotes_a_hostile_interface_name_so_that_sourcing_it_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    nodes = two_nodes(interface="e$(touch)`x`;")
    assert len(nodes[1].interface) <= 15
    text = cluster_env(nodes, nodes[1])
    env = env_of(text.replace("touch", f"touch {marker}"))  # even a longer payload would stay a value
    assert env["GLOO_SOCKET_IFNAME"] == "e$(touch)`x`;".replace("touch", f"touch {marker}")
    assert not marker.exists()
    assert "GLOO_SOCKET_IFNAME='e$(touch)`x`;'" in text


@pytest.mark.parametrize("interface", ["eth 1", "eth1,eth2", "a/b", "", "x" * 16])
def test_a_node_refuses_an_interface_name_linux_would_not_give_or_that_would_split_nccls_list(interface):
    with pytest.raises(NotConnectable, match="interface"):
        two_nodes(interface=interface)


@pytest.mark.parametrize("address", ["198.18.1.12 slots=99", "node-1", "198.18.1.300"])
def test_a_node_refuses_a_cluster_address_that_is_not_an_ip_so_no_hostfile_line_can_be_forged(address):
    with pytest.raises(NotConnectable, match="not an IP address"):
        two_nodes(address=address)


def test_ranks_must_run_from_zero_without_holes():
    nodes = [two_nodes()[0], two_nodes(rank=2)[1]]
    with pytest.raises(NotConnectable, match="0 to 1"):
        hostfile(nodes)


def test_hosts_lines_name_every_node_by_its_cluster_address_between_markers():
    assert hosts_lines(two_nodes()) == (
        "# fadenstack cluster nodes: begin\n198.18.1.11 node-0\n198.18.1.12 node-1\n# fadenstack cluster nodes: end\n")


# ------------------------------------------------------------------ the launcher commands, exactly


def test_ssh_command_is_root_at_the_machines_address_with_the_jump_and_port_when_given():
    head, worker = two_nodes(ssh_port=2222)
    assert ssh_command(head) == "ssh root@198.18.0.11"
    assert ssh_command(worker, jump="admin@console.example:22") == "ssh -J admin@console.example:22 -p 2222 root@198.18.0.12"
    assert ssh_command(head, jump="a b") == "ssh -J 'a b' root@198.18.0.11"


def test_torchrun_is_the_same_command_on_every_node_loading_its_settings_first():
    cut = snippets(two_nodes(), NET)
    per_node = ("set -a; . /etc/fadenstack/cluster.env; set +a; CUDA_VISIBLE_DEVICES=$FADEN_FREE_GPUS torchrun"
                " --nnodes=$WORLD_NODES --nproc-per-node=$GPUS_PER_NODE"
                " --rdzv-id=gpu-room --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT train.py")
    assert cut.torchrun_node == per_node
    assert cut.torchrun == f"for node in node-0 node-1; do ssh \"$node\" '{per_node}' & done; wait"
    # what each node's shell receives is exactly the per-node command
    assert shlex.split(cut.torchrun.split(' ssh "$node" ', 1)[1].rsplit(" & done", 1)[0]) == [per_node]


def test_torchrun_brackets_an_ipv6_head_for_the_rendezvous():
    net = ClusterNet(name="v6", network="fd00::/64", head_address="fd00::11")
    assert "--rdzv-endpoint=[$MASTER_ADDR]:$MASTER_PORT" in torchrun_node(net)


def test_mpirun_starts_one_process_per_gpu_across_the_hostfile_each_loading_its_nodes_settings():
    assert snippets(two_nodes(), NET).mpirun == (
        "mpirun --allow-run-as-root --hostfile /etc/fadenstack/hostfile -np 12 --mca btl_tcp_if_include 198.18.1.0/24"
        " bash -c 'set -a; . /etc/fadenstack/cluster.env; set +a; CUDA_VISIBLE_DEVICES=$FADEN_FREE_GPUS exec python train.py'")


def test_deepspeed_reads_the_hostfile_and_gets_every_nodes_interface_since_it_exports_the_heads_nccl_settings():
    assert snippets(two_nodes(), NET).deepspeed == (
        "NCCL_SOCKET_IFNAME==eth1,ens5 deepspeed --hostfile /etc/fadenstack/hostfile --master_addr 198.18.1.11"
        " --master_port 29500 train.py")
    same = snippets(two_nodes(interface="eth1"), NET).deepspeed
    assert same.startswith("NCCL_SOCKET_IFNAME==eth1 deepspeed")


def test_ray_commands_go_through_the_tunnel_to_the_heads_loopback():
    cut = snippets(two_nodes(), NET, jump="jump.example")
    assert cut.ray_job_submit == ("ray job submit --address http://127.0.0.1:8265 --working-dir . --runtime-env-json"
                                  " '{\"env_vars\": {\"CUDA_VISIBLE_DEVICES\": \"0,1,2,3,4,5,6,7\"}}' -- python3 train.py")
    assert cut.ray_tunnel == "ssh -N -L 8265:127.0.0.1:8265 -L 10001:127.0.0.1:10001 -J jump.example root@198.18.0.11"
    assert cut.ssh_commands == {"node-0": "ssh -J jump.example root@198.18.0.11", "node-1": "ssh -J jump.example root@198.18.0.12"}


def test_a_hostile_cluster_name_and_script_stay_single_words_in_every_command():
    hostile = ClusterNet(name="x; reboot #", network="198.18.1.0/24", head_address="198.18.1.11")
    cut = snippets(two_nodes(), hostile, script="run me.py; rm -rf /")
    assert "--rdzv-id='x; reboot #'" in cut.torchrun_node
    assert shlex.split(cut.torchrun_node)[-1] == "run me.py; rm -rf /"
    for command in (cut.deepspeed, cut.ray_job_submit):
        assert shlex.split(command)[-1] == "run me.py; rm -rf /"
    # mpirun's bash -c body is one word, and inside it the script is one word again
    body = shlex.split(cut.mpirun)[-1]
    assert shlex.split(body)[-1] == "run me.py; rm -rf /"
    # and the head's shell hands each node the per-node command as a single argument
    remote = cut.torchrun.split(' ssh "$node" ', 1)[1].rsplit(" & done", 1)[0]
    assert shlex.split(remote) == [cut.torchrun_node]


def test_snippets_as_dict_names_what_the_api_returns():
    assert set(snippets(two_nodes(), NET).as_dict()) == {
        "ssh_commands", "torchrun", "torchrun_node", "mpirun", "deepspeed", "ray_job_submit", "ray_tunnel"}


def test_cluster_net_reads_the_head_from_rank_zero_and_normalises_the_subnet():
    net = ClusterNet.of("gpu-room", "198.18.1.7/24", list(reversed(two_nodes())))
    assert (net.head_address, net.network, net.master_port) == ("198.18.1.11", "198.18.1.0/24", 29500)
    with pytest.raises(NotConnectable, match="not a subnet"):
        ClusterNet.of("gpu-room", "lab", two_nodes())
