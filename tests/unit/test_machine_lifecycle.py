"""The machine lifecycle is a table; one guard moves every machine through it."""
import pytest

from machines.choices import MACHINE_BADGE, TRANSITIONS, EventKind, MachineState
from machines.models import MachineEvent
from machines.services import InvalidTransition, machine_transition
from tests.factories import MachineFactory

ALL_STATES = set(MachineState.values)
BADGE_COLOURS = {"amber", "blue", "green", "grey", "red"}


def test_transitions_name_every_machine_state_and_only_real_states():
    assert set(TRANSITIONS) == ALL_STATES
    for source, targets in TRANSITIONS.items():
        assert targets, f"{source} is a dead end"
        assert targets <= ALL_STATES, f"{source} leads to states that do not exist: {targets - ALL_STATES}"
        assert source not in targets, f"{source} lists itself; staying put is not a transition"


def test_every_state_can_be_reached_from_a_new_machine():
    reached, frontier = {MachineState.HOST_KEY}, [MachineState.HOST_KEY]
    while frontier:
        for target in TRANSITIONS[frontier.pop()]:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == ALL_STATES


def test_every_state_has_a_badge_colour():
    assert set(MACHINE_BADGE) == ALL_STATES
    assert set(MACHINE_BADGE.values()) <= BADGE_COLOURS


@pytest.mark.django_db
def test_machine_transition_refuses_every_move_the_table_forbids():
    machine = MachineFactory()
    for source in MachineState:
        for target in ALL_STATES - TRANSITIONS[source] - {source}:
            machine.state = source
            with pytest.raises(InvalidTransition, match=f"cannot go from {source.label} to {MachineState(target).label}"):
                machine_transition(machine=machine, to=target)
    assert not MachineEvent.objects.filter(machine=machine).exists()


@pytest.mark.django_db
def test_machine_transition_refuses_a_host_key_machine_going_straight_to_healthy():
    machine = MachineFactory(awaiting_host_key=True)
    with pytest.raises(InvalidTransition):
        machine_transition(machine=machine, to=MachineState.HEALTHY)
    machine.refresh_from_db()
    assert machine.state == MachineState.HOST_KEY


@pytest.mark.django_db
def test_machine_transition_saves_an_allowed_move_and_records_it_as_an_event():
    machine = MachineFactory(state=MachineState.HEALTHY)
    before = machine.state_changed_at

    assert machine_transition(machine=machine, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.") is True

    machine.refresh_from_db()
    assert machine.state == MachineState.OFFLINE
    assert machine.state_reason == "No heartbeat for 31 s."
    assert machine.state_changed_at > before
    event = MachineEvent.objects.get(machine=machine)
    assert event.kind == EventKind.STATE
    assert event.message == "Healthy → Offline: No heartbeat for 31 s."


@pytest.mark.django_db
def test_machine_transition_to_the_same_state_is_a_no_op_that_records_nothing():
    machine = MachineFactory(state=MachineState.HEALTHY)
    changed_at = machine.state_changed_at

    assert machine_transition(machine=machine, to=MachineState.HEALTHY) is False

    machine.refresh_from_db()
    assert machine.state == MachineState.HEALTHY
    assert machine.state_changed_at == changed_at
    assert not MachineEvent.objects.filter(machine=machine).exists()


@pytest.mark.django_db
def test_machine_transition_to_the_same_state_refreshes_only_the_reason():
    machine = MachineFactory(state=MachineState.FAILED, state_reason="Could not reach it.")
    assert machine_transition(machine=machine, to=MachineState.FAILED, reason="It refused the key.") is False
    machine.refresh_from_db()
    assert machine.state_reason == "It refused the key."
    assert not MachineEvent.objects.filter(machine=machine).exists()
