"""Users' own jobs and the GPUs (issue 26, slip 3): the processes the console did not start on a machine's
GPUs, as facts and heartbeats report them, stored on its accelerators and said on its page; placement never
puts a copy on such a GPU; and what a person's own job may use (the GPUs no copy holds) in the hostfile,
cluster.env and on the Connect card."""
import html
import re
import shlex
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from clusters import connection_texts, hooks
from clusters.node_files import node_files_specs
from console import roles
from deployments import placement, placement_input
from deployments.choices import CopyState
from deployments.models import Copy
from machines import beats, services
from machines.models import Accelerator
from tests.builders import build, cluster_of, deployment_of, gpu_machine
from tests.factories import UserFactory

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "agent"))
from fadenstack_agent import nodespec  # noqa: E402 - the agent's own check, read from agent/ as machines run it

pytestmark = pytest.mark.django_db

H100 = placement.GpuKind(vendor="nvidia", model="H100 80GB", memory_bytes=81559 * 2**20)


def processes(*entries):
    return [{"gpu_uuid": uuid, "pid": pid, "used_memory_mib": mib, "console": console} for uuid, pid, mib, console in entries]


def gpu(machine, index) -> Accelerator:
    return machine.accelerators.get(index=index)


# -- what the agent reports, read strictly -----------------------------------------------------------------


def test_only_the_processes_the_console_did_not_start_count_and_what_is_not_a_process_is_skipped():
    use = beats.foreign_gpu_use(processes(("GPU-a", 4121, 2048, False), ("GPU-a", 977, None, False),
                                          ("GPU-a", 5000, 30000, True), ("GPU-b", 4121, 2048, False))
                                + [{"gpu_uuid": "GPU-c", "pid": "7"}, {"gpu_uuid": "GPU-c", "pid": 8}, "nonsense",
                                   {"gpu_uuid": "GPU-d", "pid": -1, "console": False}, {"gpu_uuid": 5, "pid": 9, "console": False}])
    assert use == {"GPU-a": ([977, 4121], 2048), "GPU-b": ([4121], 2048)}


@pytest.mark.parametrize("absent", [None, {}, "[]", 12])
def test_no_list_is_none_so_that_what_the_console_knows_stays(absent):
    assert beats.foreign_gpu_use(absent) is None
    assert beats.foreign_gpu_use([]) == {}


# -- stored on the machine's accelerators ------------------------------------------------------------------


def beat(machine, payload):
    return services.machine_heartbeat(machine=machine, payload=payload)


def test_a_heartbeat_puts_a_persons_job_on_its_gpu_and_a_later_one_without_it_clears_it():
    machine = gpu_machine("lab-a", 11, accelerators=4)
    third = gpu(machine, 3)
    beat(machine, {"gpu_processes": processes((third.uuid, 4121, 2048, False), (gpu(machine, 0).uuid, 88, 100, True))})
    assert gpu(machine, 3).foreign_pids == [4121] and gpu(machine, 3).foreign_memory_mib == 2048
    assert [a.foreign_pids for a in machine.accelerators.all()] == [[], [], [], [4121]]  # the copy's engine is not one

    beat(machine, {"agent_version": "0.9.0"})  # a beat that did not read the GPUs changes nothing
    assert gpu(machine, 3).foreign_pids == [4121]

    beat(machine, {"gpu_processes": []})
    assert gpu(machine, 3).foreign_pids == [] and gpu(machine, 3).foreign_memory_mib is None


def test_facts_put_the_processes_on_the_gpus_they_report():
    machine = gpu_machine("lab-a", 11, accelerators=0)
    facts = {"arch": "x86_64", "accelerators": [
        {"index": i, "vendor": "nvidia", "model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "uuid": f"GPU-{i}"}
        for i in range(4)], "gpu_processes": processes(("GPU-2", 4121, 512, False), ("GPU-2", 4122, 512, False))}
    services.machine_facts_apply(machine=machine, facts=facts)
    assert gpu(machine, 2).foreign_pids == [4121, 4122] and gpu(machine, 2).foreign_memory_mib == 1024


def test_the_machines_page_says_which_gpu_a_process_the_console_did_not_start_uses(client):
    machine = gpu_machine("lab-a", 11, accelerators=4)
    Accelerator.objects.filter(machine=machine, index=3).update(foreign_pids=[4121], foreign_memory_mib=2048)
    client.force_login(UserFactory(username="viewer", role=roles.VIEWER))
    text = html.unescape(client.get(f"/machines/{machine.pk}/").content.decode())
    assert "GPU 3: used by a process the console did not start, pid 4121 (2048 MiB)." in text
    assert text.count("used by a process the console did not start") == 1
    Accelerator.objects.filter(machine=machine, index=1).update(foreign_pids=[7, 9])
    text = html.unescape(client.get(f"/machines/{machine.pk}/").content.decode())
    assert "GPU 1: used by processes the console did not start, pids 7, 9." in text


def test_the_machines_api_gives_each_gpus_foreign_processes(api_client):
    machine = gpu_machine("lab-a", 11, accelerators=4)
    Accelerator.objects.filter(machine=machine, index=3).update(foreign_pids=[4121], foreign_memory_mib=2048)
    devices = api_client.get(f"/api/machines/{machine.pk}/").json()["accelerators"]["devices"]
    assert [(d["index"], d["foreign_pids"], d["foreign_memory_mib"]) for d in devices] == [
        (0, [], None), (1, [], None), (2, [], None), (3, [4121], 2048)]


# -- placement ---------------------------------------------------------------------------------------------


def test_placement_counts_a_gpu_a_persons_job_uses_as_taken_whatever_copies_hold_of_it():
    a, b = gpu_machine("lab-a", 11, accelerators=4), gpu_machine("lab-b", 12, accelerators=4)
    cluster = cluster_of([a, b])
    Accelerator.objects.filter(machine=a, index__in=[0, 2]).update(foreign_pids=[4121])
    room = {m.name: m for m in placement_input.cluster_rooms(cluster)}
    assert [g.share_taken for g in room["lab-a"].gpus] == [1, 0, 1, 0]
    assert [g.share_taken for g in room["lab-b"].gpus] == [0, 0, 0, 0]


# GPUs per copy -> GPUs the copies take of the 8 left free (each machine has 3 free: a copy of 2 fits once, of 4 never)
@pytest.mark.parametrize("gpus_per_copy, taken_gpus", [(Fraction(1, 4), 8), (Fraction(1, 2), 8), (1, 8), (2, 6), (4, 0)])
def test_no_copy_is_ever_placed_on_a_gpu_a_persons_job_uses(gpus_per_copy, taken_gpus):
    machines = [gpu_machine(f"lab-{n}", 11 + i, accelerators=4) for i, n in enumerate("abc")]
    cluster = cluster_of(machines)
    used = {(machines[0].pk, 0), (machines[0].pk, 3), (machines[1].pk, 1), (machines[2].pk, 2)}
    for machine_id, index in used:
        Accelerator.objects.filter(machine_id=machine_id, index=index).update(foreign_pids=[4000 + index])
    wanted = [placement.CopyWanted(key=f"d1-c{i}", deployment=1, gpus=gpus_per_copy, memory_per_gpu_bytes=2**30,
                                   kind=H100, arch="x86_64") for i in range(40)]
    result = placement.plan(placement_input.cluster_rooms(cluster), wanted)
    taken = {(slot.machine_id, index) for copy in result.placed for slot in copy.slots for index in slot.gpu_indices}
    assert len(taken) == taken_gpus
    assert not taken & used
    if not taken_gpus:
        assert result.unplaced[0].reason.startswith("no machine has 4 free H100 80GB (the most free on one is 3")


# -- what a person's own job may use: the GPUs no copy holds ---------------------------------------------


@pytest.fixture
def held_room(settings, tmp_path):
    """lab-a (8 GPUs) and lab-b (4): a serving copy holds lab-a's 0 and 1, a stopped one (it comes back when
    the cluster starts) lab-b's 3, a quarter of lab-b's 0 is held too, and a queued copy without a place holds nothing."""
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "ssh" / "ca_ed25519"
    settings.FADEN_MACHINES_REACHABLE, settings.FADEN_SSH_JUMP = True, ""
    a, b = gpu_machine("lab-a", 11), gpu_machine("lab-b", 12, accelerators=4)
    cluster = cluster_of([a, b], runtime=build("2.1.0"))
    deployment = deployment_of(cluster, copies=4, gpu_quarters=8)
    for number, state, machine, slots in (
            (1, CopyState.SERVING, a, [{"machine": a.pk, "gpus": [0, 1], "quarters": 4, "port": 8100}]),
            (2, CopyState.STOPPED, b, [{"machine": b.pk, "gpus": [3], "quarters": 4, "port": 8100}]),
            (3, CopyState.STARTING, b, [{"machine": b.pk, "gpus": [0], "quarters": 1, "port": 8101}]),
            (4, CopyState.QUEUED, None, [])):
        Copy.objects.create(deployment=deployment, number=number, state=state, machine=machine, slots=slots)
    return cluster, a, b


def test_the_gpus_copies_hold_are_asked_of_deployments_through_the_clusters_hook(held_room):
    cluster, a, b = held_room
    assert hooks.gpus_held(cluster) == {a.pk: {0, 1}, b.pk: {0, 3}}


def test_free_accelerators_leave_out_a_gpu_a_persons_job_uses_as_placement_does(held_room):
    cluster, a, b = held_room
    before = placement_input.accelerators_held(cluster, [a.pk, b.pk])
    # lab-a's GPU 1 a copy holds whole already, its GPU 5 nothing; a quarter of lab-b's GPU 0 is held.
    for machine, index in ((a, 1), (a, 5), (b, 0)):
        Accelerator.objects.filter(machine=machine, index=index).update(foreign_pids=[4121])
    assert placement_input.accelerators_held(cluster, [a.pk, b.pk]) == before + 1 + Fraction(3, 4)


def test_each_nodes_free_gpus_are_those_no_copy_holds_and_the_hostfile_counts_them(held_room):
    cluster, _, _ = held_room
    head, worker = connection_texts.nodes_of(cluster)
    assert (head.free_gpus, worker.free_gpus) == ((2, 3, 4, 5, 6, 7), (1, 2))
    assert connection_texts.hostfile([head, worker]) == "198.18.1.11 slots=6\n198.18.1.12 slots=2\n"


def env_of(text):
    out = subprocess.run(["bash", "-c", "set -a; . /dev/stdin; set +a; env -0"], input=text, capture_output=True,
                         text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


def test_cluster_env_says_which_gpus_are_free_and_how_many(held_room):
    cluster, _, _ = held_room
    nodes = connection_texts.nodes_of(cluster)
    head_env, worker_env = (env_of(connection_texts.cluster_env(nodes, node)) for node in nodes)
    assert (head_env["FADEN_FREE_GPUS"], head_env["GPUS_PER_NODE"]) == ("2,3,4,5,6,7", "6")
    assert (worker_env["FADEN_FREE_GPUS"], worker_env["GPUS_PER_NODE"]) == ("1,2", "2")


def test_a_node_whose_gpus_copies_hold_all_is_left_out_of_the_hostfile_and_its_env_says_none():
    head = connection_texts.Node(rank=0, machine="lab-a", address="198.18.1.11", interface="eth1", gpus=8, free_gpus=())
    worker = connection_texts.Node(rank=1, machine="lab-b", address="198.18.1.12", interface="eth1", gpus=4)
    assert connection_texts.hostfile([head, worker]) == "198.18.1.12 slots=4\n"
    env = env_of(connection_texts.cluster_env([head, worker], head))
    assert (env["FADEN_FREE_GPUS"], env["GPUS_PER_NODE"]) == ("", "0")
    with pytest.raises(connection_texts.NotConnectable, match="lab-a: its free GPUs"):
        connection_texts.Node(rank=0, machine="lab-a", address="198.18.1.11", interface="eth1", gpus=2, free_gpus=(0, 1, 2))


def test_the_node_files_the_agent_checks_carry_the_free_gpus(held_room):
    cluster, _, _ = held_room
    specs = node_files_specs(cluster)
    assert specs["lab-a"]["hostfile"] == "198.18.1.11 slots=6\n198.18.1.12 slots=2\n"
    assert "\nFADEN_FREE_GPUS=1,2\n" in specs["lab-b"]["cluster_env"]
    for spec in specs.values():
        nodespec.check_spec(spec)  # the agent writes them as they are


def test_the_launchers_use_the_free_gpus_and_ray_job_submit_tells_the_job_the_heads(held_room):
    cluster, _, _ = held_room
    nodes = connection_texts.nodes_of(cluster)
    cut = connection_texts.snippets(nodes, connection_texts.ClusterNet.of(cluster.name, cluster.network, nodes))
    assert " -np 8 " in cut.mpirun  # 6 + 2 slots
    assert "CUDA_VISIBLE_DEVICES=$FADEN_FREE_GPUS exec python train.py" in shlex.split(cut.mpirun)[-1]
    assert "CUDA_VISIBLE_DEVICES=$FADEN_FREE_GPUS torchrun" in cut.torchrun_node
    deepspeed = shlex.split(cut.deepspeed)
    assert deepspeed[deepspeed.index("--include") + 1] == "198.18.1.11:2,3,4,5,6,7@198.18.1.12:1,2"
    submit = shlex.split(cut.ray_job_submit)
    assert submit[submit.index("--runtime-env-json") + 1] == '{"env_vars": {"CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7"}}'
    assert submit[-3:] == ["--", "python3", "train.py"]


def test_the_api_gives_each_nodes_free_gpus(held_room, api_client):
    cluster, _, _ = held_room
    nodes = api_client.get(f"/api/clusters/{cluster.pk}/").json()["connection"]["nodes"]
    assert [(n["name"], n["gpus"], n["free_gpus"]) for n in nodes] == [("node-0", 8, [2, 3, 4, 5, 6, 7]), ("node-1", 4, [1, 2])]


def test_deepspeed_is_not_told_which_gpus_when_no_copy_holds_any():
    nodes = [connection_texts.Node(rank=0, machine="lab-a", address="198.18.1.11", interface="eth1", gpus=8)]
    cut = connection_texts.snippets(nodes, connection_texts.ClusterNet.of("room", "198.18.1.0/24", nodes))
    assert "--include" not in cut.deepspeed


def test_the_connect_card_lists_each_nodes_free_gpus_live(held_room, client):
    cluster, _, _ = held_room
    client.force_login(UserFactory(username="ops", role=roles.OPERATOR))
    text = html.unescape(client.get(f"/clusters/{cluster.pk}/").content.decode())
    card = re.search(r'<section id="cluster-connect".*?</section>', text, re.S).group(0)
    assert re.search(r'id="connect-free-0">free for your jobs: <span class="mono">2,3,4,5,6,7</span>', card)
    assert re.search(r'id="connect-free-1">free for your jobs: <span class="mono">1,2</span>', card)
    assert "FADEN_FREE_GPUS" in card and "CUDA_VISIBLE_DEVICES" in card
    Copy.objects.filter(number=3).update(state=CopyState.STOPPING, slots=[{"machine": 0, "gpus": [0]}])
    text = html.unescape(client.get(f"/clusters/{cluster.pk}/").content.decode())
    assert re.search(r'id="connect-free-1">free for your jobs: <span class="mono">0,1,2</span>', text)
