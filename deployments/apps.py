from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Deployments"

    def ready(self) -> None:
        from clusters import hooks

        hooks.delete_blocker_register("deployments", deployments_refusal)
        hooks.page_card_register("deployments", template="deployments/_cluster_models.html", context=cluster_models_card)


def deployments_refusal(cluster) -> str | None:
    """A cluster with deployments is not deleted: no model may be left running on its machines."""
    count = cluster.deployments.count()
    if not count:
        return None
    return (f"{cluster.name} still has {count} deployment{'s' if count != 1 else ''}: "
            "delete them first, so that no model is left running on the machines.")


def cluster_models_card(cluster) -> dict:
    """The cluster page's "Models on this cluster" card and its Deployments figure."""
    deployments = list(cluster.deployments.all()[:20])
    return {"deployments": deployments, "deployment_count": cluster.deployments.count() if len(deployments) == 20 else len(deployments)}
