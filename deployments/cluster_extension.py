"""What deployments answer when the cluster asks (clusters/hooks.py's ClusterExtension): the copies of models
on its machines refuse its deletion, hold its accelerators, serve on its GPUs, are looked at in its health
check, and have cards on its page."""
from __future__ import annotations

from fractions import Fraction

from clusters.hooks import PageCard
from console.models import Job
from deployments import copy_health, orphans, placement_input
from deployments.choices import CopyState
from deployments.models import Copy
from deployments.selectors import deployments_list
from deployments.store.selectors import models_on_cluster
from deployments.store.sources import model_source_card

CARD_ROWS = 20  # deployments listed on the cluster's card at most


class DeploymentsExtension:
    name = copy_health.QUESTION  # each machine's answer to the health question is kept under it

    def delete_refusal(self, cluster) -> str | None:
        """A cluster with deployments is not deleted: no model may be left running on its machines (one running
        without a deployment neither: it is taken over first)."""
        count = cluster.deployments.shown().count()
        orphaned = cluster.deployments.filter(orphaned_at__isnull=False).count()
        reasons = []
        if count:
            reasons.append(f"{cluster.name} still has {count} deployment{'s' if count != 1 else ''}: "
                           "delete them first, so that no model is left running on the machines.")
        if orphaned:
            reasons.append(f"{orphaned} model{'s' if orphaned != 1 else ''} still run{'s' if orphaned == 1 else ''} on "
                           f"{cluster.name} without a deployment: take them over (keep or delete them) first.")
        return " ".join(reasons) or None

    def accelerators_held(self, cluster, machine_ids: list[int]) -> Fraction:
        return placement_input.accelerators_held(cluster, machine_ids)

    def gpus_held(self, cluster) -> dict[int, set[int]]:
        return placement_input.gpus_held(cluster)

    def serving_copies(self, cluster) -> int:
        """The copies serving on the cluster now: the NCCL test, which takes every GPU, asks before it slows them."""
        return Copy.objects.filter(deployment__cluster=cluster, state=CopyState.SERVING).count()

    def held_out_of_ray(self, cluster) -> set[int]:
        """Drained machines: Ray lets their node go, and a health check does not join them again."""
        from deployments.drain import held_out_of_ray

        return held_out_of_ray(cluster)

    def machine_notes(self, cluster) -> dict[int, dict]:
        """Each draining machine's drain, for its panel and row on the cluster page: its state in words, its
        badge, why, and whether Stop drain or Cancel removal applies now (one query for the cluster)."""
        from deployments.choices import DrainState
        from deployments.models import Drain

        return {d.machine_id: {"label": d.get_state_display(), "badge": d.badge, "reason": d.state_reason,
                               "cancel": d.remove and d.state != DrainState.LEAVING,
                               "stop": not d.remove and d.state not in (DrainState.STOPPING, DrainState.LEAVING)}
                for d in Drain.objects.filter(cluster=cluster)}

    def health_question(self, agent, member) -> list[dict] | None:
        return copy_health.copies_ask(agent, member)

    def after_check(self, cluster, answers: dict[int, dict]) -> None:
        copy_health.copies_checked(cluster, answers)

    def page_cards(self) -> list[PageCard]:
        return [PageCard("deployments", template="deployments/_cluster_models.html", context=cluster_models_card),
                PageCard(orphans.LIVE_PART, template="deployments/_cluster_orphans.html", context=orphans_card),
                PageCard("model-source", template="deployments/_model_source.html", context=model_source_card)]


def cluster_models_card(cluster, role) -> dict:
    """The cluster page's "Models on this cluster" card and its Deployments figure, with the models its
    machines hold (copied ahead of a deployment, or for one)."""
    deployments = deployments_list(cluster.deployments.all(), limit=CARD_ROWS)
    return {"deployments": deployments, "held_models": models_on_cluster(cluster),
            "deployment_count": cluster.deployments.shown().count() if len(deployments) == CARD_ROWS else len(deployments)}


def orphans_card(cluster, role) -> dict:
    """The cluster page's "Models running here without a deployment": Look for them, what the last look and the
    records found, and Take over a model (keep it, or delete it properly), each with its job's state."""
    found = orphans.orphans_of(cluster)
    for orphan in found:
        orphan.keep = orphans.take_offer(cluster, orphan, keep=True, role=role)
        orphan.delete = orphans.take_offer(cluster, orphan, keep=False, role=role)
    look = orphans.last_look(cluster)
    return {"orphans": {"found": found, "look": orphans.look_offer(cluster, role), "last_look": look,
                        "not_asked": (look.params.get("not_asked") or []) if look else [],
                        "job": Job.objects.filter(target_type=orphans.TARGET, target_id=cluster.pk).defer("log")
                        .order_by("-created_at").first()}}
