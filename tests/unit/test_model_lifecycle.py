"""A model's lifecycle in the server's store: the table names only real states and reaches all of them from
Downloading, and the one guard the download job and Try again write through refuses every move the table
does not allow without writing anything."""
from collections import deque

import pytest

from console.lifecycle import InvalidTransition
from deployments.store import downloads
from deployments.choices import MODEL_TRANSITIONS, ModelState
from deployments.models import StoredModel

# Sorted: a frozenset's order differs between processes, and xdist's workers must collect the same tests in one order.
ALLOWED = [(source, target) for source, targets in MODEL_TRANSITIONS.items() for target in sorted(targets)]
FORBIDDEN = [(source, target) for source in ModelState for target in ModelState
             if source != target and target not in MODEL_TRANSITIONS[source]]


def test_the_model_table_names_only_real_states():
    states = set(ModelState)
    assert set(MODEL_TRANSITIONS) == states
    for source, targets in MODEL_TRANSITIONS.items():
        assert targets <= states and source not in targets


def test_every_model_state_is_reached_from_downloading():
    seen, todo = {ModelState.DOWNLOADING}, deque([ModelState.DOWNLOADING])
    while todo:
        for target in MODEL_TRANSITIONS[todo.popleft()] - seen:
            seen.add(target)
            todo.append(target)
    assert seen == set(ModelState)


def test_a_ready_model_is_never_downloaded_again_nor_failed():
    assert (ModelState.READY, ModelState.DOWNLOADING) in FORBIDDEN
    assert (ModelState.READY, ModelState.FAILED) in FORBIDDEN


def model_in(state: str) -> StoredModel:
    return StoredModel.objects.create(repo="org/chat", state=state, state_reason="As the test left it.", rate=5.0)


@pytest.mark.django_db
@pytest.mark.parametrize("source, target", FORBIDDEN)
def test_the_guard_refuses_every_move_the_table_forbids_and_writes_nothing(source, target):
    model = model_in(source)

    with pytest.raises(InvalidTransition, match=f"org/chat cannot go from {ModelState(source).label} to "
                                                f"{ModelState(target).label}"):
        downloads.model_transition(model, to=target, reason="Moved.", rate=0)

    saved = StoredModel.objects.get(pk=model.pk)
    assert (saved.state, saved.state_reason, saved.rate) == (source, "As the test left it.", 5.0)


@pytest.mark.django_db
@pytest.mark.parametrize("source, target", ALLOWED)
def test_the_guard_makes_every_move_the_table_allows(source, target):
    model = model_in(source)

    downloads.model_transition(model, to=target, reason="Moved.", rate=0)

    saved = StoredModel.objects.get(pk=model.pk)
    assert (saved.state, saved.state_reason, saved.rate) == (target, "Moved.", 0)


@pytest.mark.django_db
def test_a_model_deleted_meanwhile_is_left_gone(monkeypatch):
    monkeypatch.setattr(downloads, "model_changed", lambda model, part="": None)
    model = model_in(ModelState.DOWNLOADING)
    StoredModel.objects.filter(pk=model.pk).delete()

    downloads._failed(model, "The hub could not be reached.")

    assert not StoredModel.objects.exists()


@pytest.mark.django_db
def test_a_failed_download_of_a_model_that_became_ready_keeps_it_ready(monkeypatch):
    """The download's failure (and the reaper's) moves only a download under way: a late one cannot unmake
    a ready model."""
    monkeypatch.setattr(downloads, "model_changed", lambda model, part="": None)
    model = model_in(ModelState.READY)

    downloads._failed(model, "The worker running this job stopped before it finished.")

    assert StoredModel.objects.get(pk=model.pk).state == ModelState.READY
