"""The one push helper: after commit, once per topic and part, never on rollback."""
import pytest
from django.db import transaction

from console import live


def test_parse_topic_knows_the_registered_topics_and_nothing_else():
    assert live.parse_topic("machines") == ("machines", "")
    assert live.parse_topic("machine:12") == ("machine", "12")
    assert live.parse_topic("clusters-of-someone-else") is None
    assert live.parse_topic("machine:12;DROP") is None
    assert live.parse_topic("Machine:12") is None


def test_group_names_hold_only_what_channels_accepts():
    assert live.group_name("machine:12") == "live.machine.12"


@pytest.mark.django_db
def test_several_pushes_of_the_same_thing_in_one_transaction_wait_for_one_commit(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        live.push("machine:12")
        live.push("machine:12")
        live.push("machines", part="12")
        live.push("machines", part="12")
        live.push("machines", part="13")

    assert sorted(callback.live_key for callback in callbacks) == [("machine:12", ""), ("machines", "12"), ("machines", "13")]


@pytest.mark.django_db
def test_a_push_in_a_transaction_that_rolls_back_is_never_sent(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            live.push("machine:12")
            raise RuntimeError("rolled back")
    assert callbacks == []
