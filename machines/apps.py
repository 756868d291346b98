from django.apps import AppConfig


class MachinesConfig(AppConfig):
    name = "machines"
    verbose_name = "Machines"

    def ready(self) -> None:
        from console import dashboard, live
        from console.jobs import job_kind_register
        from console.metrics import metrics_register
        from console.pruning import register_pruner
        from machines import enrolment, services, ssh_certificates, steps, views
        from machines.metrics import MachinesCollector

        live.register("machines", views.render_machines_topic, may_see=views.may_see_machines_topic,
                      takes=live.one_of("", "summary"))
        live.register("machine", views.render_machine_topic, takes=live.an_id)
        # The dashboard shows the summary live (machines:summary sends nothing else) and the last events.
        dashboard.register(
            dashboard.Panel(
                name="machine-summary",
                template="machines/machine_list.html#summary",
                context=lambda request: {"summary": views.machine_summary()},
                topics=(services.SUMMARY_TOPIC,),
                order=10,
                wide=True,
            )
        )
        dashboard.register(
            dashboard.Panel(name="machine-events", template="machines/_recent_events.html", context=views.recent_events, order=20)
        )

        # A machine reads Enrolling while its job runs: one the reaper fails reads Failed instead.
        job_kind_register(steps.ENROL.kind, task="machines.tasks.machine_enrol", on_failed=enrolment.machine_enrol_abandoned)
        job_kind_register(steps.REFRESH.kind, task="machines.tasks.machine_enrol")
        job_kind_register(steps.UPDATE_AGENT.kind, task="machines.tasks.machine_update_agent")
        register_pruner("machine events", services.machine_events_prune, keep_days_setting="FADEN_KEEP_EVENTS_DAYS")
        register_pruner("ssh certificates", ssh_certificates.certificates_prune, keep_days_setting="FADEN_KEEP_CERTIFICATES_DAYS")
        metrics_register("machines", MachinesCollector())
