"""The cluster's one extension point (clusters/hooks.py's ClusterExtension): what deployments answer
through it, and how the cluster puts the answers of several extensions together."""
from fractions import Fraction

import pytest
from django.core.exceptions import ValidationError


from clusters import actions, hooks, pages
from clusters.choices import ClusterState
from console import roles
from deployments import services
from deployments.cluster_extension import DeploymentsExtension
from deployments.forms import ask_from
from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


class MountsExtension:
    """A second app on the cluster's machines: it refuses deletes, holds half a GPU, serves two copies."""

    name = "mounts"

    def delete_refusal(self, cluster):
        return f"{cluster.name} still has a mount."

    def accelerators_held(self, cluster, machine_ids):
        return Fraction(1, 2)

    def gpus_held(self, cluster):
        return {}

    def serving_copies(self, cluster):
        return 2

    def health_question(self, agent, member):
        return None

    def after_check(self, cluster, answers):
        pass

    def page_cards(self):
        return [hooks.PageCard("mounts", template="clusters/_mounts.html", context=lambda cluster, role: {})]


@pytest.fixture
def room():
    return cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)])


@pytest.fixture
def with_mounts(monkeypatch):
    monkeypatch.setattr(hooks, "_extensions", dict(hooks._extensions))
    hooks.extension_register(MountsExtension())


def test_deployments_register_one_extension_that_answers_every_question_of_the_protocol():
    registered = hooks.extensions()
    assert [type(e) for e in registered] == [DeploymentsExtension]
    assert isinstance(registered[0], hooks.ClusterExtension) and isinstance(MountsExtension(), hooks.ClusterExtension)


def test_the_delete_refusal_reaches_the_delete_offer_after_the_role(room):
    assert actions.cluster_actions(room, None, role=roles.OPERATOR)["delete"].ok
    deployment_of(room)

    offer = actions.cluster_actions(room, None, role=roles.OPERATOR)["delete"]
    assert not offer.ok and not offer.forbidden
    assert offer.why == ("gpu-room still has 1 deployment: delete them first, so that no model is left running on "
                         "the machines.")
    viewer = actions.cluster_actions(room, None, role=roles.VIEWER)["delete"]
    assert viewer.forbidden and "needs an Operator" in viewer.why


def test_the_answers_of_several_extensions_are_put_together(room, with_mounts):
    deployment_of(room)
    joined = list(room.members.all())

    assert hooks.delete_refusal(room).endswith("left running on the machines. gpu-room still has a mount.")
    assert hooks.accelerators_free(room, joined) == 15.5  # 16 GPUs, no copy, half a GPU held by the mounts
    assert hooks.serving_copies(room) == 2
    assert [card.name for card in pages.page_cards()] == ["connect", "nccl", "node_logins", "deployments", "orphans", "model-source",
                                                       "mounts"]


@pytest.mark.parametrize("state", [ClusterState.STOPPED, ClusterState.STARTING, ClusterState.FAILED])
def test_deploying_needs_a_running_cluster_in_one_sentence_for_the_page_and_the_service(state):
    cluster = cluster_of([gpu_machine("gpu-a", 11)], state=state)
    model = ready_model()
    offer = actions.cluster_actions(cluster, None, role=roles.OPERATOR)["deploy"]
    assert offer.why == actions.deploy_refusal(cluster) == (
        f"gpu-room is {cluster.get_state_display().lower()}: models are deployed on a running cluster.")

    form = {"cluster": cluster.pk, "model": model.pk, "name": "llama", "copies": 1, "kind": "nvidia|H100 80GB|81559|x86_64",
            "gpu_quarters": 4, "memory_per_gpu_gib": 72, "context_length": 8192}
    with pytest.raises(ValidationError) as refusal:
        services.deployment_create(ask=ask_from(form), user=UserFactory(role=roles.OPERATOR))
    assert refusal.value.messages == [offer.why]
