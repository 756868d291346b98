from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Deployments"

    def ready(self) -> None:
        from clusters import hooks
        from console import live
        from console.jobs import job_kind_register
        from deployments import copies, copy_health, downloads, pages, rooms, serving, sources
        from machines.cards import machine_card_register

        hooks.delete_blocker_register("deployments", deployments_refusal)
        hooks.accelerators_held_register("copies", rooms.accelerators_held)
        hooks.serving_copies_register("copies", serving_copies)
        hooks.health_question_register(copy_health.QUESTION, copy_health.copies_ask)
        hooks.health_extension_register("copies", copy_health.copies_checked)
        hooks.page_card_register("deployments", template="deployments/_cluster_models.html", context=cluster_models_card)
        hooks.page_card_register("model-source", template="deployments/_model_source.html", context=sources.model_source_card)
        machine_card_register("models", template="deployments/_machine_models.html", context=machine_models_card)
        machine_card_register("copies", template="deployments/_machine_copies.html", context=machine_copies_card)
        live.register("models", pages.render_models_topic)
        live.register("model", pages.render_model_topic, takes=live.an_id)
        live.register("deployments", pages.render_deployments_topic)
        live.register("deployment", pages.render_deployment_topic, takes=live.an_id)

        # A download survives its worker: huggingface_hub's partial files let another one go on.
        job_kind_register(downloads.KIND, task="deployments.tasks.model_download", resumable=True,
                          on_failed=downloads.model_download_abandoned)
        job_kind_register(copies.KIND, task="deployments.tasks.model_copy", resumable=True)
        job_kind_register(copies.REMOVE_KIND, task="deployments.tasks.model_remove")
        job_kind_register(sources.KIND, task="deployments.tasks.model_source_check")
        # One apply job per deployment claims and starts copies; a new worker takes up a dead one's.
        job_kind_register(serving.KIND, task="deployments.tasks.deployment_apply", resumable=True,
                          on_failed=serving.apply_abandoned)
        job_kind_register(serving.DELETE_KIND, task="deployments.tasks.deployment_delete", resumable=True)

        hooks.cluster_stopping.connect(_cluster_stopping, dispatch_uid="deployments-stopping")
        hooks.cluster_running.connect(_cluster_running, dispatch_uid="deployments-running")
        hooks.members_joined.connect(_members_joined, dispatch_uid="deployments-members-joined")


def _cluster_stopping(sender, cluster, deleting=False, **kwargs) -> None:
    from deployments import serving

    serving.cluster_stopping(cluster, deleting=deleting)


def _cluster_running(sender, cluster, **kwargs) -> None:
    from deployments import serving

    serving.cluster_running(cluster)


def _members_joined(sender, cluster_id, machine_ids=(), **kwargs) -> None:
    """A machine joined the cluster or came back: queued copies may fit on it now."""
    from deployments import serving

    serving.queued_woken(cluster_id)


def deployments_refusal(cluster) -> str | None:
    """A cluster with deployments is not deleted: no model may be left running on its machines."""
    count = cluster.deployments.count()
    if not count:
        return None
    return (f"{cluster.name} still has {count} deployment{'s' if count != 1 else ''}: "
            "delete them first, so that no model is left running on the machines.")


def serving_copies(cluster) -> int:
    """The copies serving on the cluster now: the NCCL test, which takes every GPU, asks before it slows them."""
    from deployments.choices import CopyState
    from deployments.models import Copy

    return Copy.objects.filter(deployment__cluster=cluster, state=CopyState.SERVING).count()


def cluster_models_card(cluster, role) -> dict:
    """The cluster page's "Models on this cluster" card and its Deployments figure, with the models its
    machines hold (copied ahead of a deployment, or for one)."""
    from deployments.selectors import models_on_cluster

    from deployments.selectors import deployments_list

    deployments = deployments_list(cluster.deployments.all(), limit=20)
    return {"deployments": deployments, "held_models": models_on_cluster(cluster),
            "deployment_count": cluster.deployments.count() if len(deployments) == 20 else len(deployments)}


def machine_models_card(machine) -> dict:
    """A machine page's "Models in its store" card."""
    return {"machine_models": list(machine.model_holdings.select_related("model"))}


def machine_copies_card(machine) -> dict:
    """A machine page's "Copies of models on it" card."""
    from deployments.selectors import machine_copies

    return {"machine_copies": machine_copies(machine)}
