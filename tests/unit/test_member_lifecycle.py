"""A member's lifecycle: the table names only real states and reaches all of them, and the one guard
refuses a move the table does not allow without writing anything."""
from collections import deque

import pytest

from clusters.choices import MEMBER_TRANSITIONS, MemberState
from clusters.lifecycle import InvalidTransition, member_transition, members_transition
from clusters.models import ClusterMember
from console import live
from tests.builders import build, cluster_of, gpu_machine


def test_the_member_table_names_only_real_states():
    states = set(MemberState)
    assert set(MEMBER_TRANSITIONS) == states
    for source, targets in MEMBER_TRANSITIONS.items():
        assert targets <= states, f"{source} names {targets - states}"


def test_every_member_state_is_reached_from_waiting_to_start():
    seen, todo = {MemberState.PENDING}, deque([MemberState.PENDING])
    while todo:
        for target in MEMBER_TRANSITIONS[todo.popleft()] - seen:
            seen.add(target)
            todo.append(target)
    assert seen == set(MemberState)


def test_a_stop_ends_a_member_in_any_state_and_a_start_begins_again_from_any_state_it_leaves():
    for state in set(MemberState) - {MemberState.STOPPED}:
        assert MemberState.STOPPED in MEMBER_TRANSITIONS[state]
    for state in set(MemberState) - {MemberState.PENDING, MemberState.REJOINING}:
        assert MemberState.PENDING in MEMBER_TRANSITIONS[state]


@pytest.fixture
def pushes(monkeypatch):
    sent = []
    monkeypatch.setattr(live, "push", lambda topic, part="": sent.append((topic, part)))
    return sent


@pytest.fixture
def member(db):
    cluster = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=build("2.1.0"))
    return cluster.members.get(machine__name="gpu-b")


def test_a_move_the_table_allows_is_saved_with_its_reason_and_time_and_pushed(member, pushes):
    before = member.state_changed_at

    member_transition(member, to=MemberState.DOWN, reason="Ray's node list does not hold gpu-b as alive.")

    saved = ClusterMember.objects.get(pk=member.pk)
    assert (saved.state, saved.state_reason) == (MemberState.DOWN, "Ray's node list does not hold gpu-b as alive.")
    assert saved.state_changed_at > before
    assert (f"cluster:{member.cluster_id}", "members") in pushes


def test_a_move_the_table_refuses_raises_and_writes_nothing(member, pushes):
    ClusterMember.objects.filter(pk=member.pk).update(state=MemberState.STOPPED)

    with pytest.raises(InvalidTransition, match="gpu-b cannot go from Stopped to Up"):
        member_transition(member, to=MemberState.JOINED)

    assert ClusterMember.objects.get(pk=member.pk).state == MemberState.STOPPED
    assert pushes == []


def test_a_group_move_refuses_them_all_when_one_may_not_go(member, pushes):
    head = member.cluster.members.get(machine__name="gpu-a")
    ClusterMember.objects.filter(pk=head.pk).update(state=MemberState.STOPPED)

    with pytest.raises(InvalidTransition):
        members_transition(member.cluster.members.all(), to=MemberState.REJOINING)

    assert set(member.cluster.members.values_list("state", flat=True)) == {MemberState.STOPPED, MemberState.JOINED}


def test_only_from_moves_the_members_in_those_states_and_leaves_the_others(member, pushes):
    moved = members_transition(member.cluster.members.all(), to=MemberState.FAILED, reason="gone",
                               only_from=[MemberState.PENDING])

    assert moved == 0
    assert set(member.cluster.members.values_list("state", flat=True)) == {MemberState.JOINED}
