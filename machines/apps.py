from django.apps import AppConfig


class MachinesConfig(AppConfig):
    name = "machines"
    verbose_name = "Machines"

    def ready(self) -> None:
        from console import live
        from console.pruning import register_pruner
        from machines import services, views

        live.register("machines", views.render_machines_topic)
        live.register("machine", views.render_machine_topic)
        register_pruner("machine events", services.machine_events_prune, keep_days_setting="FADEN_KEEP_EVENTS_DAYS")
