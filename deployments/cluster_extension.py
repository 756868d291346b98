"""What deployments answer when the cluster asks (clusters/hooks.py's ClusterExtension): the copies of models
on its machines refuse its deletion, hold its accelerators, serve on its GPUs, are looked at in its health
check, and have cards on its page."""
from __future__ import annotations

from fractions import Fraction

from clusters.hooks import PageCard
from deployments import copy_health, placement_input
from deployments.choices import CopyState
from deployments.models import Copy
from deployments.selectors import deployments_list
from deployments.store.selectors import models_on_cluster
from deployments.store.sources import model_source_card

CARD_ROWS = 20  # deployments listed on the cluster's card at most


class DeploymentsExtension:
    name = copy_health.QUESTION  # each machine's answer to the health question is kept under it

    def delete_refusal(self, cluster) -> str | None:
        """A cluster with deployments is not deleted: no model may be left running on its machines."""
        count = cluster.deployments.count()
        if not count:
            return None
        return (f"{cluster.name} still has {count} deployment{'s' if count != 1 else ''}: "
                "delete them first, so that no model is left running on the machines.")

    def accelerators_held(self, cluster, machine_ids: list[int]) -> Fraction:
        return placement_input.accelerators_held(cluster, machine_ids)

    def gpus_held(self, cluster) -> dict[int, set[int]]:
        return placement_input.gpus_held(cluster)

    def serving_copies(self, cluster) -> int:
        """The copies serving on the cluster now: the NCCL test, which takes every GPU, asks before it slows them."""
        return Copy.objects.filter(deployment__cluster=cluster, state=CopyState.SERVING).count()

    def health_question(self, agent, member) -> list[dict] | None:
        return copy_health.copies_ask(agent, member)

    def after_check(self, cluster, answers: dict[int, dict]) -> None:
        copy_health.copies_checked(cluster, answers)

    def page_cards(self) -> list[PageCard]:
        return [PageCard("deployments", template="deployments/_cluster_models.html", context=cluster_models_card),
                PageCard("model-source", template="deployments/_model_source.html", context=model_source_card)]


def cluster_models_card(cluster, role) -> dict:
    """The cluster page's "Models on this cluster" card and its Deployments figure, with the models its
    machines hold (copied ahead of a deployment, or for one)."""
    deployments = deployments_list(cluster.deployments.all(), limit=CARD_ROWS)
    return {"deployments": deployments, "held_models": models_on_cluster(cluster),
            "deployment_count": cluster.deployments.count() if len(deployments) == CARD_ROWS else len(deployments)}
