from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Console"

    def ready(self) -> None:
        from console.jobs import jobs_prune
        from console.pruning import register_pruner

        register_pruner("jobs", jobs_prune, keep_days_setting="FADEN_KEEP_JOBS_DAYS")
