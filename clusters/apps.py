from django.apps import AppConfig


class ClustersConfig(AppConfig):
    name = "clusters"
    verbose_name = "Clusters"

    def ready(self) -> None:
        from clusters import views
        from console import live

        live.register("clusters", views.render_clusters_topic)
        live.register("cluster", views.render_cluster_topic)
        live.register("probe", views.render_probe_topic)
