from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Console"

    def ready(self) -> None:
        from console import dashboard, live_sessions, views
        from console.jobs import jobs_prune
        from console.pruning import register_pruner

        dashboard.register(dashboard.Panel(name="recent-jobs", template="console/_recent_jobs.html", context=views.recent_jobs, order=30))
        register_pruner("jobs", jobs_prune, keep_days_setting="FADEN_KEEP_JOBS_DAYS")
        live_sessions.connect_signals()
