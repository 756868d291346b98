from django.apps import AppConfig


class MachinesConfig(AppConfig):
    name = "machines"
    verbose_name = "Machines"

    def ready(self) -> None:
        from console import live
        from machines import views

        live.register("machines", views.render_machines_topic)
        live.register("machine", views.render_machine_topic)
