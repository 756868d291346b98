"""Starting clusters on the lab: the image machine to machine over the cluster's network, then real Ray."""
import json
import threading
import time

import pytest
from django.core.exceptions import ValidationError

from clusters import services
from clusters.choices import ClusterState, MemberState
from clusters.models import Cluster, NcclTest, NcclTestState, Transfer
from clusters.nccl_api import NcclTestSerializer
from machines import remote
from machines.agent_client import Agent
from machines.models import Machine
from machines.services import machine_target
from tests.integration import connect_lab
from tests.harness import FABRIC, enrol, images_import, leave_nothing_running, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.django_db(transaction=True)]

@pytest.fixture
def enrolled(lab, console_url, settings):
    """Enrol the named lab machines (the lab's image builds imported first); afterwards every machine
    they touched is left with no Ray, no file server and no image in its store, as the next test expects."""
    settings.FADEN_HEARTBEAT_INTERVAL = 2  # machines that lose power read Offline within seconds
    settings.FADEN_OFFLINE_AFTER = 6
    images_import(lab)
    names = []

    def enrol_these(*wanted):
        names.extend(wanted)
        return enrol(lab, *wanted)

    yield enrol_these
    # The clusters read Stopped first: a heartbeat that finds Ray gone from a machine cleared below
    # would have its cluster checked and restarted in the live server, racing this teardown.
    Cluster.objects.update(state=ClusterState.STOPPED)
    lab.heal()
    leave_nothing_running(Machine.objects.filter(name__in=names))


def remote_out(machine: Machine, command: str) -> str:
    with remote.connect(machine_target(machine)) as conn:
        return remote.run(conn, ["sh", "-c", command]).stdout


def ray_nodes(head: Machine, address: str) -> list[dict]:
    with Agent.open(head) as agent:
        return agent.ray_status(head=f"{address}:6379").raw["nodes"]


def start_in_background(name: str, machines, *, until_fraction_on: Machine, fraction: float) -> threading.Event:
    """Create and start the cluster in a thread; return once ``until_fraction_on`` holds that much of the image."""
    done = threading.Event()

    def start():
        try:
            services.cluster_create(name=name, machine_ids=[m.pk for m in machines], head_id=machines[0].pk, network=FABRIC)
        finally:
            done.set()

    threading.Thread(target=start).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        cluster = Cluster.objects.filter(name=name).first()
        transfer = cluster and Transfer.objects.filter(member__cluster=cluster, member__machine=until_fraction_on).first()
        if transfer and transfer.bytes_total and transfer.bytes_done > transfer.bytes_total * fraction:
            break
        time.sleep(0.05)
    return done


def test_four_machines_of_two_platforms_reach_running_and_a_transfer_cut_in_the_middle_resumes(lab, enrolled, api_client,
                                                                                              api_token, console_url, tmp_path,
                                                                                              settings):
    """One start for all of it: the x86_64 image down the chain (the server, lab-a, lab-b, lab-c), the
    aarch64 build from the server to lab-d (each build leaves the server once), lab-b's fabric link pulled
    while its copy is under way, which it resumes with at most one chunk sent again; then the cluster as
    the API shows it, and as a person connecting to it meets it (tests/integration/connect_lab.py)."""
    a, b, c, d = enrolled("lab-a", "lab-b", "lab-c", "lab-d")
    networks = api_client.get(f"/api/clusters/networks/?machines={a.pk},{b.pk},{c.pk},{d.pk}").json()
    assert networks["suggested"] == FABRIC
    done = start_in_background("gpu-room", [a, b, c, d], until_fraction_on=b, fraction=0.3)
    lab.fault("lab-b", "link-down", "fabric")
    time.sleep(3)  # a cut, not a blip: the transfer notices and tries again
    lab.fault("lab-b", "link-up", "fabric")
    assert done.wait(300)

    cluster = Cluster.objects.get(name="gpu-room")
    assert cluster.state == ClusterState.RUNNING, cluster.state_reason
    members = {m.machine.name: m for m in cluster.members.select_related("machine")}
    assert {m.state for m in members.values()} == {MemberState.JOINED}
    assert members["lab-a"].image_transfer.source == members["lab-d"].image_transfer.source == "the server"
    assert members["lab-b"].image_transfer.source.startswith("lab-a (198.18.1.11)")
    assert members["lab-c"].image_transfer.source.startswith("lab-b (198.18.1.12)")
    assert members["lab-a"].runtime_image != members["lab-d"].runtime_image  # another architecture, another build
    nodes = [n for n in ray_nodes(a, "198.18.1.11") if n["alive"]]
    assert sorted(n["address"] for n in nodes) == ["198.18.1.11", "198.18.1.12", "198.18.1.13", "198.18.1.14"]
    assert all(n["gpus"] == 0 for n in nodes), "the cluster's Ray hands out no GPU: the console's placement does"
    image = members["lab-b"].runtime_image
    assert image.size_bytes <= members["lab-b"].image_transfer.bytes_fetched <= image.size_bytes + image.chunk_size

    shown = api_client.get(f"/api/clusters/{cluster.pk}/").json()
    assert shown["state"] == "running", shown["state_reason"]
    assert shown["machines_up"] == 4 and shown["accelerators"] == shown["free_accelerators"] == 8 + 8 + 4 + 4
    assert all(m["image_bytes_done"] == m["image_bytes_total"] > 0 for m in shown["members"])
    assert f"root@{a.address}" in shown["connection"]["nodes"][0]["ssh_command"]

    nodes = connect_lab.check_node_settings(cluster)
    connect_lab.check_certificate_logins(cluster, nodes[1], console_url=console_url, token=api_token.key, home=tmp_path / "ada")
    connect_lab.check_node_to_node(cluster, nodes, home=tmp_path / "ada")
    connect_lab.check_shared_files(cluster, nodes)
    connect_lab.check_ray_job_through_the_tunnel(cluster, console_url=console_url, token=api_token.key, home=tmp_path / "ada")
    check_nccl_test_on_nodes_of_different_gpu_counts(cluster, api_client, settings)


def check_nccl_test_on_nodes_of_different_gpu_counts(cluster, api_client, settings):
    """8, 8, 4 and 4 GPUs: one process per GPU (24), the sizes and their check as on even nodes (the
    rate on the fabric is test_cluster_life_lab's), and nothing of the run left on any machine."""
    settings.FADEN_NCCL_TEST_MAX_BYTES, settings.FADEN_NCCL_TEST_ITERS, settings.FADEN_NCCL_TEST_WARMUP = 4 * 2**20, 2, 1
    started = api_client.post(f"/api/clusters/{cluster.pk}/tests/", {"confirm": False}, format="json")
    assert started.status_code == 201, started.content
    test = started.json()
    ended = wait_for(lambda: NcclTest.objects.filter(pk=test["id"]).exclude(state=NcclTestState.RUNNING).first(),
                     timeout=180, what="the NCCL test to end")
    shown = NcclTestSerializer(ended).data
    assert shown["state"] == "finished", (shown["message"], connect_lab.job_log(shown))
    assert (ended.nodes, ended.gpus) == (4, 24)
    assert [row["size_bytes"] for row in shown["rows"]] == [2**20, 2**21, 2**22]
    assert shown["peak"]["busbw"] > 0 and shown["message"].startswith("Peak ")
    job_log = connect_lab.job_log(shown)
    assert "all_reduce_perf on 4 nodes from lab-a" in job_log
    for member in cluster.members.select_related("machine"):
        left = remote_out(member.machine, "pgrep --ns $$ --nslist net -af '[a]ll_reduce_perf|[o]rted|[m]pirun' || true")  # this machine's own (the lab's share the host's pids)
        assert not left.strip(), f"{member.machine.name}: {left}"


def test_a_machine_without_room_says_how_much_is_needed_and_writes_nothing(lab, enrolled):
    (c,) = enrolled("lab-c")
    lab.fault("lab-c", "disk-full")
    try:
        cluster = services.cluster_create(name="no-room", machine_ids=[c.pk], head_id=c.pk, network=FABRIC)
    finally:
        lab.fault("lab-c", "disk-free")

    cluster.refresh_from_db()
    assert cluster.state == ClusterState.WAITING
    assert "Needs" in cluster.state_reason and "free in /var/lib/fadenstack" in cluster.state_reason
    with remote.connect(machine_target(c)) as conn:
        listing = remote.run(conn, ["ls", "-A", "/var/lib/fadenstack/blobs"]).stdout
    # Neither <digest>.part nor a finished <digest> (the agent's store since 0.2).
    assert ".part" not in listing and not [name for name in listing.split() if len(name) == 64]


def test_a_port_taken_waits_for_try_again_which_succeeds_once_it_is_freed(lab, enrolled):
    (a,) = enrolled("lab-a")
    lab.fault("lab-a", "port-taken", "6379")
    try:
        cluster = services.cluster_create(name="port", machine_ids=[a.pk], head_id=a.pk, network=FABRIC)
        cluster.refresh_from_db()
        assert cluster.state == ClusterState.WAITING
        assert "Address already in use" in cluster.state_reason
    finally:
        lab.fault("lab-a", "port-free", "6379")

    services.cluster_retry(cluster=cluster)

    cluster.refresh_from_db()
    assert cluster.state == ClusterState.RUNNING, cluster.state_reason
    # The process runtime's Ray runs with TLS too, reading its files at the machine's own paths (docs/https-and-trust.md).
    environ = remote_out(a, f"for p in $(pgrep -x gcs_server); do tr '\\0' ' ' < /proc/$p/cmdline | grep -q '{cluster.head_address}' "
                            f"&& tr '\\0' '\\n' < /proc/$p/environ | grep '^RAY_TLS_SERVER_CERT='; done")
    assert environ.strip() == "RAY_TLS_SERVER_CERT=/etc/fadenstack/clusters/port/tls/node.pem"


def test_lab_e_is_refused_in_the_wizard_and_over_the_api(enrolled, admin_client):
    a, e = enrolled("lab-a", "lab-e")

    with pytest.raises(ValidationError) as refused:
        services.cluster_create(name="amd", machine_ids=[a.pk, e.pk], head_id=a.pk, network="198.18.0.0/24")
    assert "No certified runtime image runs on lab-e" in " ".join(refused.value.messages)

    page = admin_client.get(f"/clusters/new/?step=machines&name=amd&machines={a.pk},{e.pk}")
    assert "No certified runtime image runs on lab-e" in page.content.decode()

    response = admin_client.post("/api/clusters/", {"name": "amd", "machines": [a.pk, e.pk], "head": a.pk,
                                                     "network": "198.18.0.0/24"}, content_type="application/json")
    assert response.status_code == 400
    assert "No certified runtime image runs on lab-e" in json.dumps(response.json())
    assert not Cluster.objects.exists()


def test_a_machine_that_loses_power_in_the_middle_does_not_leave_the_start_stuck(lab, enrolled):
    from machines.services import machines_mark_offline

    a, b = enrolled("lab-a", "lab-b")
    done = start_in_background("power", [a, b], until_fraction_on=b, fraction=0)
    deadline = time.monotonic() + 150  # 6 s to read Offline (30 s in the product), then the start moves on
    lab.fault("lab-b", "power-off")
    try:
        # Beat's job in production: machines without a heartbeat for FADEN_OFFLINE_AFTER s read Offline.
        while not done.wait(1):
            machines_mark_offline()
            assert time.monotonic() < deadline, "the start is stuck on a machine that lost power"
    finally:
        lab.fault("lab-b", "power-on")

    cluster = Cluster.objects.get(name="power")
    member = cluster.members.get(machine=b)
    assert member.state == MemberState.FAILED
    # Its own words: cut off mid-command it "went offline", at a new command it "did not answer".
    assert member.state_reason.startswith("lab-b")
    assert any(words in member.state_reason for words in ("went offline", "did not answer", "Could not connect")), member.state_reason
    assert cluster.state == ClusterState.RUNNING  # the head runs; the totals say one machine is missing
    assert cluster.members.get(machine=a).state == MemberState.JOINED
