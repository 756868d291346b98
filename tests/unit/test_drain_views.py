"""Drain and Remove from cluster in the pages (deployments/drain_views.py): the drain plan for the machines
chosen, the agree button that starts one drain per machine, a plan that changed since it was read, and
machines that cannot be drained together."""
import pytest

from deployments.choices import CopyState
from deployments.drain_input import DRAIN_AGENT
from deployments.models import Copy, Drain, ModelHolding
from tests.builders import cluster_of, deployment_of, gpu_machine

pytestmark = pytest.mark.django_db

NEW = {"agent_version": DRAIN_AGENT}


@pytest.fixture
def lab(queued):
    """lab-a leads, lab-b and lab-c work; llama's files on lab-b and lab-c, its copy 1 serving on lab-b."""
    machines = [gpu_machine(f"lab-{n}", 11 + i, accelerators=4, **NEW) for i, n in enumerate("abc")]
    cluster = cluster_of(machines)
    llama = deployment_of(cluster, name="llama-8b", copies=1)
    for machine in machines[1:]:
        ModelHolding.objects.create(model=llama.model, machine=machine)
    copy = Copy.objects.create(deployment=llama, number=1, state=CopyState.SERVING, machine=machines[1],
                               slots=[{"machine": machines[1].pk, "gpus": [0], "quarters": 4, "port": 8100}])
    return cluster, machines, copy


def test_the_plan_page_says_where_each_copy_moves_and_the_button_starts_the_drain(admin_client, lab):
    cluster, (a, b, c), copy = lab
    page = admin_client.get(f"/deployments/drain/plan/?machines={b.pk}").content.decode()
    assert "Drain lab-b" in page and "llama-8b #1" in page and "Moves to lab-c (GPU 0 · port 8100)" in page
    assert 'name="stops" value="0"' in page

    answer = admin_client.post("/deployments/drain/start/", {"machines": [b.pk], "stops": "0"})

    assert answer.status_code == 302 and answer["Location"] == cluster.get_absolute_url()
    drain = Drain.objects.get(machine=b)
    assert drain.plan["moves"][0]["copy"] == copy.pk and drain.plan["moves"][0]["to"] == c.pk and not drain.remove
    # The cluster's page shows the drain beside the machine, with Stop drain in its panel.
    html = admin_client.get(f"{cluster.get_absolute_url()}?machine={b.pk}").content.decode()
    assert html.count(">Starting the drain</span>") == 2  # its panel and its row
    assert f'formaction="/deployments/machines/{b.pk}/stop-drain/"' in html


def test_a_plan_that_stops_more_copies_than_the_one_read_starts_nothing(admin_client, lab):
    cluster, (a, b, c), copy = lab
    ModelHolding.objects.filter(machine=c).delete()  # since it was read, lab-c lost llama's files: the copy would stop

    answer = admin_client.post("/deployments/drain/start/", {"machines": [b.pk], "stops": "0"}, follow=True)

    assert not Drain.objects.exists()
    assert "The plan changed since you read it: 1 copies would stop now, not 0." in answer.content.decode()
    assert "Drain and stop 1" in answer.content.decode()  # the new plan, to read again


def test_remove_from_a_running_cluster_drains_first_then_the_machine_leaves(admin_client, lab):
    cluster, (a, b, c), copy = lab
    page = admin_client.get(f"/deployments/drain/plan/?machines={b.pk}&remove=1").content.decode()
    assert "Remove lab-b" in page and ">Remove</button>" in page

    admin_client.post("/deployments/drain/start/", {"machines": [b.pk], "remove": "1", "stops": "0"})

    assert Drain.objects.get(machine=b).remove


def test_the_head_cannot_be_drained_while_the_cluster_runs(admin_client, lab):
    cluster, (a, b, c), copy = lab
    page = admin_client.get(f"/deployments/drain/plan/?machines={a.pk}").content.decode()
    assert "lab-a leads gpu-room: the cluster cannot run without it. Stop the cluster instead, or drain the other machines." in page
    assert "disabled" in page.split("Drain</button>")[0].rsplit("<button", 1)[1]
    admin_client.post("/deployments/drain/start/", {"machines": [a.pk], "stops": "0"})
    assert not Drain.objects.exists()


def test_machines_of_two_clusters_or_of_none_are_refused_in_words(admin_client, lab):
    cluster, (a, b, c), copy = lab
    other = cluster_of([gpu_machine("far-a", 31, **NEW)], name="far-room")
    loose = gpu_machine("loose", 41, **NEW)
    far = other.members.get().machine
    answer = admin_client.post("/deployments/drain/plan/", {"machines": [b.pk, far.pk]}, follow=True)
    assert "The machines are in 2 clusters (far-room, gpu-room): drain the machines of one cluster at a time." in answer.content.decode()
    answer = admin_client.get(f"/deployments/drain/plan/?machines={loose.pk}", follow=True)
    assert "loose is in no cluster: only a cluster&#x27;s machines are drained." in answer.content.decode()
    answer = admin_client.get("/deployments/drain/plan/?machines=x", follow=True)
    assert "Choose machines by their ids." in answer.content.decode()
