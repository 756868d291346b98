"""The drain plan read from the database (deployments/drain_input.py): the copies on the machines to
drain and where their files are, the plan as Drain.plan keeps it, the refusals the card shows before
anything starts, and the drain plan card itself."""
import html
import re

import pytest
from django.db import connection
from django.template.loader import render_to_string
from django.test.utils import CaptureQueriesContext

from clusters.choices import ClusterState
from deployments.choices import CopyState, DrainState
from deployments.drain_input import DRAIN_AGENT, drain_card, drain_plan_for, drain_refusals, plan_json
from deployments.models import Copy, Drain, ModelHolding
from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model

pytestmark = pytest.mark.django_db

NEW = {"agent_version": DRAIN_AGENT}


@pytest.fixture
def lab():
    """lab-a leads, lab-b and lab-c work (4 H100 each, agents recent enough); llama's files on lab-b and lab-c."""
    machines = [gpu_machine(f"lab-{n}", 11 + i, accelerators=4, **NEW) for i, n in enumerate("abc")]
    cluster = cluster_of(machines)
    llama = deployment_of(cluster, name="llama-8b", copies=2)
    for machine in machines[1:]:
        ModelHolding.objects.create(model=llama.model, machine=machine)
    return cluster, machines, llama


def serving(deployment, number, *slots, state=CopyState.SERVING):
    """A copy with ``slots`` as (machine, [GPU indices], quarters, port)."""
    return Copy.objects.create(deployment=deployment, number=number, state=state, machine=slots[0][0],
                               slots=[{"machine": m.pk, "gpus": gpus, "quarters": quarters, "port": port}
                                      for m, gpus, quarters, port in slots])


def test_a_serving_copy_moves_to_the_other_machine_holding_its_files(lab):
    cluster, (a, b, c), llama = lab
    copy = serving(llama, 1, (b, [0], 4, 8100))
    plan = drain_plan_for(cluster, [b.pk])
    assert plan.stops == []
    assert [(m.copy, m.to_name, m.slots[0].gpu_indices, m.slots[0].port) for m in plan.moves] == [(copy.pk, "lab-c", (0,), 8100)]
    assert plan_json(plan) == {"moves": [{"copy": copy.pk, "to": c.pk,
                                          "slots": [{"machine": c.pk, "gpus": [0], "quarters": 4, "port": 8100}]}],
                               "stops": []}


def test_a_copy_stops_when_no_other_machine_holds_the_files(lab):
    cluster, (a, b, c), llama = lab
    ModelHolding.objects.filter(machine=c).delete()
    copy = serving(llama, 1, (b, [0], 4, 8100))
    plan = drain_plan_for(cluster, [b.pk])
    assert plan_json(plan) == {"moves": [], "stops": [{"copy": copy.pk, "reason": "no other machine holds llama-8b's files"}]}


def test_a_share_stops_when_the_gpu_memory_left_is_short(lab):
    cluster, (a, b, c), llama = lab
    llama.gpu_quarters, llama.memory_per_gpu_mib = 1, 38 * 1024
    llama.save()
    other = deployment_of(cluster, ready_model("org/other"), name="qwen", gpu_quarters=2)
    other.memory_per_gpu_mib = 50 * 1024
    other.save()
    for index in range(4):
        serving(other, index + 1, (c, [index], 2, 8100 + index))
    serving(llama, 1, (b, [0], 1, 8100))
    [stop] = drain_plan_for(cluster, [b.pk]).stops
    assert stop.reason == "not enough GPU memory free on lab-c: 29.6 GiB of the 38 GiB the copy needs"


def test_a_copy_with_a_slot_on_the_drained_machine_moves_whole(lab):
    cluster, (a, b, c), llama = lab
    d = gpu_machine("lab-d", 14, accelerators=4, **NEW)
    e = gpu_machine("lab-e", 15, accelerators=4, **NEW)
    cluster.members.create(machine=d, address="198.18.1.14", state=cluster.members.first().state)
    cluster.members.create(machine=e, address="198.18.1.15", state=cluster.members.first().state)
    llama.gpu_quarters = 32
    llama.save()
    for machine in (d, e):
        ModelHolding.objects.create(model=llama.model, machine=machine)
    copy = serving(llama, 1, (c, [0, 1, 2, 3], 4, 8100), (b, [0, 1, 2, 3], 4, 8100))
    [move] = drain_plan_for(cluster, [b.pk]).moves
    assert move.copy == copy.pk
    assert [t.machine_name for t in move.slots] == ["lab-d", "lab-e"]  # lab-c keeps its slot while the copy moves


def test_copies_stopping_or_of_a_deployment_being_deleted_are_not_in_the_plan(lab):
    from django.utils import timezone

    cluster, (a, b, c), llama = lab
    serving(llama, 1, (b, [0], 4, 8100), state=CopyState.STOPPING)
    gone = deployment_of(cluster, llama.model, name="old", deleting_since=timezone.now())
    serving(gone, 1, (b, [1], 4, 8101))
    assert drain_plan_for(cluster, [b.pk]).copies == 0


def test_the_plan_reads_as_many_queries_for_many_copies_as_for_one(lab):
    cluster, (a, b, c), llama = lab
    serving(llama, 1, (b, [0], 4, 8100))
    with CaptureQueriesContext(connection) as one:
        drain_plan_for(cluster, [b.pk])
    for number in range(2, 5):
        serving(llama, number, (b, [number - 1], 4, 8100 + number))
    with CaptureQueriesContext(connection) as four:
        plan = drain_plan_for(cluster, [b.pk])
    assert len(plan.moves) == 4
    assert len(four) == len(one)


def test_a_machine_not_in_the_cluster_is_refused_by_name(lab):
    cluster, machines, llama = lab
    stranger = gpu_machine("lab-x", 30, accelerators=1)
    with pytest.raises(ValueError, match=f"Machine {stranger.pk} is not in gpu-room"):
        drain_plan_for(cluster, [stranger.pk])
    with pytest.raises(ValueError, match="Select the machines to drain"):
        drain_plan_for(cluster, [])


def test_nothing_keeps_a_worker_with_recent_agents_from_draining(lab):
    cluster, (a, b, c), llama = lab
    assert drain_refusals(cluster, [b.pk]) == ([], [])


def test_the_head_cannot_be_drained_while_the_cluster_runs(lab):
    cluster, (a, b, c), llama = lab
    refusals, _ = drain_refusals(cluster, [a.pk, b.pk])
    assert refusals == ["lab-a leads gpu-room: the cluster cannot run without it. Stop the cluster instead, "
                        "or drain the other machines."]
    cluster.state = ClusterState.STOPPED
    cluster.save()
    assert drain_refusals(cluster, [a.pk])[0] == []


def test_a_machine_draining_already_is_refused(lab):
    cluster, (a, b, c), llama = lab
    Drain.objects.create(machine=b, cluster=cluster, state=DrainState.MOVING)
    assert drain_refusals(cluster, [b.pk, c.pk])[0] == ["lab-b is draining already (Moving copies)."]


def test_old_agents_on_the_machine_and_the_head_are_named_for_an_update(lab):
    cluster, (a, b, c), llama = lab
    for machine in (a, c):
        machine.agent_version = "0.10.0"
        machine.save()
    refusals, outdated = drain_refusals(cluster, [b.pk, c.pk])
    assert refusals == ["Draining needs agent 0.11.0 or later on the machine and on the head: update lab-c and lab-a."]
    assert [m.name for m in outdated] == ["lab-c", "lab-a"]


def render(card) -> str:
    return " ".join(html.unescape(render_to_string("deployments/_drain_plan.html", {"drain": card})).split())


def words(text: str) -> str:
    """What a person reads: the card's text without its tags."""
    return re.sub(r"<[^>]+>", "", text)


def test_the_card_shows_each_copy_moving_or_stopping_and_the_agree_button(lab):
    cluster, (a, b, c), llama = lab
    serving(llama, 1, (b, [0], 4, 8100))
    other = deployment_of(cluster, ready_model("org/other"), name="qwen")
    serving(other, 1, (b, [1], 4, 8101))
    card = drain_card(cluster, [b.pk], action_url="/clusters/1/drain/")
    assert card["label"] == "Drain and stop 1" and card["can_start"]
    text = render(card)
    assert "llama-8b #1" in text and "Moves to lab-c (GPU 0 · port 8100)" in text
    assert "qwen #1" in text and "Stops: no other machine holds qwen's files" in words(text)
    assert '<form method="post" action="/clusters/1/drain/"' in text
    assert f'<input type="hidden" name="machines" value="{b.pk}">' in text
    assert '<button class="btn btn--danger btn--primary" type="submit">Drain and stop 1</button>' in text


def test_the_card_for_a_removal_reads_remove_and_with_nothing_to_stop_just_remove(lab):
    cluster, (a, b, c), llama = lab
    serving(llama, 1, (b, [0], 4, 8100))
    text = render(drain_card(cluster, [b.pk, c.pk], remove=True, action_url="/remove/"))
    assert "Remove from cluster: the plan" in text and "lab-b, lab-c" in text
    assert "Stops: no other machine holds llama-8b's files" in words(text)  # lab-c leaves too
    assert '<input type="hidden" name="remove" value="1">' in text
    assert ">Remove and stop 1</button>" in text
    ModelHolding.objects.create(model=llama.model, machine=gpu_machine("lab-d", 14, accelerators=4, **NEW))
    assert "It runs no copy: nothing moves." in render(drain_card(cluster, [c.pk], remove=True))
    assert ">Remove</button>" in render(drain_card(cluster, [c.pk], remove=True))


def test_the_card_disables_the_button_and_names_the_machines_to_update(lab):
    cluster, (a, b, c), llama = lab
    b.agent_version = "0.9.2"
    b.save()
    card = drain_card(cluster, [a.pk, b.pk], action_url="/drain/")
    assert not card["can_start"]
    text = render(card)
    assert "lab-a leads gpu-room: the cluster cannot run without it." in text
    assert "update lab-b." in text and f'<a href="/machines/{b.pk}/">lab-b</a>' in text
    assert 'type="button" disabled' in text and 'type="submit"' not in text
