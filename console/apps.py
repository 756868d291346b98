from django.apps import AppConfig
from django.db.models.signals import post_migrate


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Console"

    def ready(self) -> None:
        from django.urls import register_converter

        from console import accounts, audit_signals, dashboard, live_sessions, logins, metrics, params, roles, views
        from console.audit import audit_prune
        from console.jobs import jobs_prune
        from console.pruning import register_pruner

        dashboard.register(dashboard.Panel(name="recent-jobs", template="console/_recent_jobs.html", context=views.recent_jobs, order=30))
        register_pruner("jobs", jobs_prune, keep_days_setting="FADEN_KEEP_JOBS_DAYS")
        metrics.metrics_register("jobs", metrics.JobsCollector())
        register_pruner("audit", audit_prune, keep_days_setting="FADEN_KEEP_AUDIT_DAYS")
        accounts.connect_signals()
        live_sessions.connect_signals()
        audit_signals.connect_signals()
        logins.connect_signals()
        post_migrate.connect(roles.groups_sync_after_migrate, sender=self, dispatch_uid="console-groups-sync")
        # <id:pk> in every app's URLs: an id within the database's range (console/params.py).
        register_converter(params.IdConverter, "id")
