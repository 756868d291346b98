"""A copy's lifecycle: the table names only real states and reaches all of them from Queued, the one guard
refuses every move the table does not allow without writing anything (for one copy and for many), and the
moves the apply job and the cluster's life make in bulk go through it."""
from collections import deque
from datetime import timedelta

import pytest
from django.utils import timezone

from console.lifecycle import InvalidTransition
from deployments import serving
from deployments.choices import COPY_TRANSITIONS, CopyState
from deployments.models import Copy
from tests.builders import cluster_of, deployment_of, gpu_machine

# Sorted: a frozenset's order differs between processes, and xdist's workers must collect the same tests in one order.
ALLOWED = [(source, target) for source, targets in COPY_TRANSITIONS.items() for target in sorted(targets)]
FORBIDDEN = [(source, target) for source in CopyState for target in CopyState
             if source != target and target not in COPY_TRANSITIONS[source]]


def test_the_copy_table_names_only_real_states():
    states = set(CopyState)
    assert set(COPY_TRANSITIONS) == states
    for source, targets in COPY_TRANSITIONS.items():
        assert targets <= states, f"{source} names {targets - states}"
        assert source not in targets, f"{source} moves to itself: the guard only refreshes its reason"


def test_every_copy_state_is_reached_from_queued():
    seen, todo = {CopyState.QUEUED}, deque([CopyState.QUEUED])
    while todo:
        for target in COPY_TRANSITIONS[todo.popleft()] - seen:
            seen.add(target)
            todo.append(target)
    assert seen == set(CopyState)


def test_the_table_forbids_something_so_the_refusals_below_hold_it():
    assert len(FORBIDDEN) >= 10  # Stopping cannot go back to Serving, Queued cannot serve without starting, ...


@pytest.fixture
def deployment(db):
    return deployment_of(cluster_of([gpu_machine("gpu-a", 11)]))


def copy_in(deployment, state: str, number: int = 1) -> Copy:
    return Copy.objects.create(deployment=deployment, number=number, state=state, state_reason="As the test left it.",
                               state_changed_at=timezone.now() - timedelta(hours=1))


@pytest.mark.parametrize("source, target", FORBIDDEN)
def test_the_guard_refuses_every_move_the_table_forbids_and_writes_nothing(deployment, source, target):
    copy = copy_in(deployment, source)

    with pytest.raises(InvalidTransition, match=f"llama #1 cannot go from {CopyState(source).label} to "
                                                f"{CopyState(target).label}"):
        serving.copy_transition(copy, to=target, reason="Moved.")

    saved = Copy.objects.get(pk=copy.pk)
    assert (saved.state, saved.state_reason, saved.state_changed_at) == (source, "As the test left it.", copy.state_changed_at)


@pytest.mark.parametrize("source, target", ALLOWED)
def test_the_guard_makes_every_move_the_table_allows_with_its_reason_and_time(deployment, source, target):
    copy = copy_in(deployment, source)

    assert serving.copy_transition(copy, to=target, reason="Moved.", pid=4121)

    saved = Copy.objects.get(pk=copy.pk)
    assert (saved.state, saved.state_reason, saved.pid) == (target, "Moved.", 4121)
    assert saved.state_changed_at > copy.state_changed_at
    assert (copy.state, copy.pid) == (target, 4121)  # the caller's object follows


def test_a_refreshed_reason_keeps_the_time_the_state_changed(deployment):
    copy = copy_in(deployment, CopyState.QUEUED)

    serving.copies_transition(deployment.copy_rows.all(), to=CopyState.QUEUED, reason="Waiting for room: no H100 free.")

    saved = Copy.objects.get(pk=copy.pk)
    assert saved.state_reason == "Waiting for room: no H100 free."
    assert saved.state_changed_at == copy.state_changed_at


def test_a_bulk_move_refuses_them_all_when_one_may_not_go(deployment):
    copy_in(deployment, CopyState.SERVING, 1)
    copy_in(deployment, CopyState.STOPPING, 2)

    with pytest.raises(InvalidTransition, match="llama #2 cannot go from Stopping to Queued"):
        serving.copies_transition(deployment.copy_rows.all(), to=CopyState.QUEUED)

    assert list(deployment.copy_rows.values_list("state", flat=True)) == [CopyState.SERVING, CopyState.STOPPING]


def test_only_from_moves_the_copies_in_those_states_and_leaves_the_others(deployment):
    copy_in(deployment, CopyState.COPYING, 1)
    copy_in(deployment, CopyState.SERVING, 2)

    moved = serving.copies_transition(deployment.copy_rows.all(), to=CopyState.QUEUED, only_from=[CopyState.COPYING])

    assert moved == 1
    assert list(deployment.copy_rows.values_list("state", flat=True)) == [CopyState.QUEUED, CopyState.SERVING]


def test_a_guard_that_finds_the_copy_gone_writes_nothing_and_says_so(deployment):
    copy = copy_in(deployment, CopyState.STARTING)
    Copy.objects.filter(pk=copy.pk).delete()

    assert serving.copy_transition(copy, to=CopyState.SERVING) is False


def test_a_cluster_restart_queues_its_starting_and_serving_copies_again_through_the_guard(deployment, monkeypatch):
    """A start or restart of the cluster puts every copy through its start again where it was: the moves
    Serving -> Queued and Starting -> Queued are the table's, and a copy being stopped is left to its stop."""
    monkeypatch.setattr(serving, "apply_start", lambda deployment, user=None: None)
    for number, state in enumerate([CopyState.SERVING, CopyState.STARTING, CopyState.COPYING, CopyState.FAILED,
                                    CopyState.STOPPED, CopyState.STOPPING], start=1):
        copy_in(deployment, state, number)

    serving.cluster_running(deployment.cluster)

    assert list(deployment.copy_rows.values_list("state", flat=True)) == [CopyState.QUEUED] * 5 + [CopyState.STOPPING]
    for state in (CopyState.SERVING, CopyState.STARTING, CopyState.COPYING, CopyState.FAILED, CopyState.STOPPED):
        assert CopyState.QUEUED in COPY_TRANSITIONS[state], f"the restart's move from {state} is not the table's"
    assert set(deployment.copy_rows.values_list("pid", flat=True)) == {None}


def test_a_cluster_stop_stops_every_copy_but_one_already_stopped_through_the_guard(deployment, django_capture_on_commit_callbacks):
    for number, state in enumerate(CopyState, start=1):
        copy_in(deployment, state, number)

    serving.cluster_stopping(deployment.cluster)

    assert set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.STOPPED}
    assert deployment.copy_rows.get(number=7).state_reason == "As the test left it."  # already stopped: not touched
    assert deployment.copy_rows.get(number=1).state_reason == "gpu-room is stopped: started again when it starts."
