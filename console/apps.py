from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Console"

    def ready(self) -> None:
        from console import dashboard, views

        dashboard.register(dashboard.Panel(name="recent-jobs", template="console/_recent_jobs.html", context=views.recent_jobs, order=30))
