from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Deployments"

    def ready(self) -> None:
        from clusters import hooks
        from console import live
        from console.jobs import job_kind_register
        from console.metrics import metrics_register
        from console.pruning import register_pruner
        from deployments import drain, gateway_usage, orphans, pages, serving
        from deployments.cluster_extension import DeploymentsExtension
        from deployments.metrics import CopiesCollector, GpusCollector
        from deployments.store import downloads, machine_files, sources
        from deployments.store.pages import render_model_topic, render_models_topic
        from machines.cards import machine_card_register
        from machines.signals import machine_gpus_freed

        hooks.extension_register(DeploymentsExtension())
        machine_card_register("models", template="deployments/_machine_models.html", context=machine_models_card,
                              takes_role=True)
        machine_card_register("copies", template="deployments/_machine_copies.html", context=machine_copies_card)
        live.register("models", render_models_topic)
        live.register("model", render_model_topic, takes=live.an_id)
        live.register("deployments", pages.render_deployments_topic)
        live.register("deployment", pages.render_deployment_topic, takes=live.an_id)
        metrics_register("copies", CopiesCollector())
        metrics_register("gpus", GpusCollector())

        # A download survives its worker: huggingface_hub's partial files let another one go on.
        job_kind_register(downloads.KIND, task="deployments.tasks.model_download", resumable=True,
                          on_failed=downloads.model_download_abandoned)
        job_kind_register(machine_files.KIND, task="deployments.tasks.model_copy", resumable=True)
        job_kind_register(machine_files.REMOVE_KIND, task="deployments.tasks.model_remove")
        job_kind_register(sources.KIND, task="deployments.tasks.model_source_check")
        # One apply job per deployment claims and starts copies; a new worker takes up a dead one's.
        job_kind_register(serving.KIND, task="deployments.tasks.deployment_apply", resumable=True,
                          on_failed=serving.apply_abandoned)
        # A delete the reaper gives up on leaves what it could not stop running without a deployment, never silently.
        job_kind_register(serving.DELETE_KIND, task="deployments.tasks.deployment_delete", resumable=True,
                          on_failed=serving.delete_abandoned)
        job_kind_register(orphans.LOOK_KIND, task="deployments.tasks.orphans_look")
        job_kind_register(orphans.TAKE_KIND, task="deployments.tasks.orphan_take")
        # A drain survives its worker: each move is keyed by the copy, so none starts twice.
        job_kind_register(drain.KIND, task="deployments.tasks.machine_drain", resumable=True, on_failed=drain.drain_abandoned)

        register_pruner("gateway key usage", gateway_usage.usage_prune, keep_days_setting="FADEN_KEEP_KEY_USAGE_DAYS")

        hooks.cluster_stopping.connect(_cluster_stopping, dispatch_uid="deployments-stopping")
        hooks.cluster_running.connect(_cluster_running, dispatch_uid="deployments-running")
        hooks.members_joined.connect(_members_joined, dispatch_uid="deployments-members-joined")
        machine_gpus_freed.connect(_machine_gpus_freed, dispatch_uid="deployments-gpus-freed")


def _cluster_stopping(sender, cluster, deleting=False, **kwargs) -> None:
    from deployments import drain, serving

    drain.drains_cluster_stopping(cluster)  # first: it reads the copies on drained machines as they were
    serving.cluster_stopping(cluster, deleting=deleting)


def _cluster_running(sender, cluster, **kwargs) -> None:
    from deployments import serving

    serving.cluster_running(cluster)


def _members_joined(sender, cluster_id, machine_ids=(), **kwargs) -> None:
    """A machine joined the cluster or came back: queued copies may fit on it now."""
    from deployments import drain, serving

    drain.drains_back_in_ray(cluster_id, machine_ids)  # Stop drain: back in Ray, the drain is over
    serving.queued_woken(cluster_id)


def _machine_gpus_freed(sender, machine_id, **kwargs) -> None:
    """A person's job left a GPU: queued copies of the machine's cluster may fit there now."""
    from clusters.models import ClusterMember
    from deployments import serving

    for cluster_id in ClusterMember.objects.filter(machine_id=machine_id).values_list("cluster_id", flat=True):
        serving.queued_woken(cluster_id)


def machine_models_card(machine, role) -> dict:
    """A machine page's "Models in its store" card, with Remove for ``role`` (the files of one model on this machine)."""
    from deployments.store.actions import REMOVE

    return {"machine_models": list(machine.model_holdings.select_related("model")), "machine_models_remove": REMOVE.offer(role)}


def machine_copies_card(machine) -> dict:
    """A machine page's "Copies of models on it" card."""
    from deployments.selectors import machine_copies

    return {"machine_copies": machine_copies(machine)}
