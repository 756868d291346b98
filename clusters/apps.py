from django.apps import AppConfig


class ClustersConfig(AppConfig):
    name = "clusters"
    verbose_name = "Clusters"

    def ready(self) -> None:
        from clusters import heartbeats, leftovers, nccl_tests, pages, services, steps
        from clusters.metrics import ClustersCollector
        from clusters.pruning import health_checks_prune
        from console.pruning import register_pruner
        from clusters.runners.start import members_abandoned, start_abandoned
        from clusters.runners.stop import stop_abandoned
        from console import live
        from console.jobs import job_kind_register
        from console.metrics import metrics_register
        from machines.cards import machine_card_register
        from machines.signals import machine_reconnected, machine_runtime_reported, machine_went_offline

        live.register("clusters", pages.render_clusters_topic)
        live.register("cluster", pages.render_cluster_topic, takes=live.an_id)
        live.register("probe", pages.render_probe_topic, takes=live.an_id)

        # Every operation on a cluster survives its worker: the reaper hands it to another one.
        task = "clusters.tasks.cluster_job"
        job_kind_register(steps.START.kind, task=task, resumable=True, on_failed=start_abandoned)
        job_kind_register(steps.ADD.kind, task=task, resumable=True, on_failed=members_abandoned)
        job_kind_register(steps.REJOIN.kind, task=task, resumable=True, on_failed=members_abandoned)
        job_kind_register(steps.STOP.kind, task=task, resumable=True, on_failed=stop_abandoned)
        job_kind_register(steps.DELETE.kind, task=task, resumable=True, on_failed=stop_abandoned)
        job_kind_register(steps.LEAVE.kind, task=task, resumable=True)
        job_kind_register(steps.RENEW.kind, task=task, resumable=True)
        job_kind_register(steps.PROBE_KIND, task="clusters.tasks.network_probe")
        job_kind_register(steps.NCCL_TEST.kind, task="clusters.tasks.nccl_test", on_failed=nccl_tests.nccl_test_abandoned)
        job_kind_register(leftovers.IMAGES_KIND, task="clusters.tasks.machine_images_free")
        job_kind_register(leftovers.SHARED_KIND, task="clusters.tasks.machine_shared_free")
        machine_card_register("leftovers", template="clusters/_machine_leftovers.html", context=leftovers.leftovers_card,
                              takes_role=True)
        register_pruner("health checks", health_checks_prune, keep_days_setting="FADEN_KEEP_CHECKS_DAYS")
        metrics_register("clusters", ClustersCollector())

        def reconnected(sender, *, machine_id: int, name: str, **kwargs) -> None:
            services.cluster_machine_reconnected(machine_id=machine_id, name=name)

        def went_offline(sender, *, machine_id: int, name: str, **kwargs) -> None:
            services.cluster_machine_went_offline(machine_id=machine_id, name=name)

        def runtime_reported(sender, *, machine_id: int, name: str, failure: str, failing_since, **kwargs) -> None:
            heartbeats.cluster_heartbeat_runtime(machine_id=machine_id, name=name, failure=failure, failing_since=failing_since)

        machine_reconnected.connect(reconnected, dispatch_uid="clusters-reconnected", weak=False)
        # Node logins taken back when their holder may no longer log in; a machine back gets what it missed.
        from clusters import node_logins
        from console.jobs import task_enqueue

        node_logins.connect_signals()

        def came_back(sender, *, machine_id: int, **kwargs) -> None:
            task_enqueue("clusters.tasks.machine_came_back", machine_id)

        machine_reconnected.connect(came_back, dispatch_uid="clusters-came-back", weak=False)
        machine_went_offline.connect(went_offline, dispatch_uid="clusters-went-offline", weak=False)
        machine_runtime_reported.connect(runtime_reported, dispatch_uid="clusters-runtime-reported", weak=False)
