from django.apps import AppConfig


class ClustersConfig(AppConfig):
    name = "clusters"
    verbose_name = "Clusters"

    def ready(self) -> None:
        from clusters import views
        from console import live

        live.register("clusters", views.render_clusters_topic)
        live.register("cluster", views.render_cluster_topic)
        live.register("probe", views.render_probe_topic)

        from clusters import services, starting, stopping
        from console.jobs import job_kind_register
        from machines.signals import machine_reconnected, machine_went_offline

        # Every operation on a cluster survives its worker: the reaper hands it to another one.
        task = "clusters.tasks.cluster_job"
        job_kind_register(services.START_KIND, task=task, on_failed=starting.start_abandoned)
        job_kind_register(services.ADD_KIND, task=task, on_failed=starting.members_abandoned)
        job_kind_register(services.REJOIN_KIND, task=task, on_failed=starting.members_abandoned)
        job_kind_register(services.STOP_KIND, task=task, on_failed=stopping.stop_abandoned)
        job_kind_register(services.DELETE_KIND, task=task, on_failed=stopping.stop_abandoned)
        machine_reconnected.connect(_reconnected, dispatch_uid="clusters-reconnected")
        machine_went_offline.connect(_went_offline, dispatch_uid="clusters-went-offline")


def _reconnected(sender, *, machine_id: int, name: str, **kwargs) -> None:
    from clusters import services

    services.cluster_machine_reconnected(machine_id=machine_id, name=name)


def _went_offline(sender, *, machine_id: int, name: str, **kwargs) -> None:
    from clusters import services

    services.cluster_machine_went_offline(machine_id=machine_id, name=name)
