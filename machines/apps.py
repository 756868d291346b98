from django.apps import AppConfig


class MachinesConfig(AppConfig):
    name = "machines"
    verbose_name = "Machines"

    def ready(self) -> None:
        from console import live
        from machines import views

        live.register("machines", views.render_machines_topic)
        live.register("machine", views.render_machine_topic)

        from console.jobs import job_kind_register
        from machines.services import ENROL_KIND, REFRESH_KIND

        job_kind_register(ENROL_KIND, task="machines.tasks.machine_enrol")
        job_kind_register(REFRESH_KIND, task="machines.tasks.machine_enrol")
