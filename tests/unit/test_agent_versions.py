"""The one rule that says a machine's agent is out of date: versions compare by their numbers, and an
unknown version counts as old. The shipped version is read as the console reads it, whatever it is."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from machines.agent import agent_version
from machines.choices import MachineState
from machines.models import Machine
from machines.versions import agent_outdated, version_key

SHIPPED = agent_version()


def newer_than(version: str) -> str:
    return f"{version_key(version)[0][0] + 1}.0.0"


@pytest.mark.parametrize(("installed", "shipped"), [
    ("0.9.0", "0.10.0"),
    ("0.2.0", "0.3.0"),
    ("0.3.0rc1", "0.3.0"),
    ("0.3.0-dev", "0.3.0"),
    ("1.9.9", "2.0.0"),
    ("", "0.3.0"),
    ("not a version", "0.3.0"),
])
def test_an_older_or_unknown_agent_is_out_of_date(installed, shipped):
    assert agent_outdated(installed, shipped)


@pytest.mark.parametrize(("installed", "shipped"), [
    ("0.10.0", "0.9.0"),  # a string comparison would call this older
    ("0.3.0", "0.3.0"),
    ("0.3", "0.3.0"),
    ("1.0.0", "0.3.0"),  # newer than the console's: no downgrade is offered
])
def test_the_same_or_a_newer_agent_is_not_out_of_date(installed, shipped):
    assert not agent_outdated(installed, shipped)


@given(st.lists(st.integers(0, 999), min_size=3, max_size=3), st.lists(st.integers(0, 999), min_size=3, max_size=3))
def test_versions_order_as_their_numbers_do(a, b):
    text_a, text_b = ".".join(map(str, a)), ".".join(map(str, b))
    assert agent_outdated(text_a, text_b) == (a < b)


def test_the_machine_says_whether_its_agent_is_older_than_the_one_this_console_ships():
    assert Machine(agent_version=SHIPPED).agent_outdated is False
    assert Machine(agent_version=newer_than(SHIPPED)).agent_outdated is False
    assert Machine(agent_version="0.0.1").agent_outdated is True
    assert Machine(agent_version="").agent_outdated is True
    assert Machine().agent_latest == SHIPPED


def test_no_update_is_offered_to_a_machine_that_is_about_to_get_the_current_agent():
    assert Machine(state=MachineState.HEALTHY, agent_version="0.0.1").agent_update_available
    assert Machine(state=MachineState.OFFLINE, agent_version="").agent_update_available
    assert not Machine(state=MachineState.ENROLLING, agent_version="").agent_update_available
    assert not Machine(state=MachineState.HOST_KEY, agent_version="").agent_update_available
    assert not Machine(state=MachineState.HEALTHY, agent_version=SHIPPED).agent_update_available
