"""Deployments of models onto clusters. Only the record for now."""
from django.db import models


class Deployment(models.Model):
    name = models.CharField(max_length=63, unique=True)
    cluster = models.ForeignKey("clusters.Cluster", on_delete=models.PROTECT, related_name="deployments")
    model_name = models.CharField(max_length=255, help_text="The model, as its hub names it")
    copies = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
