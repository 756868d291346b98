"""Clusters and their members. Only the records for now; starting them comes with the wizard."""
from django.db import models


class ClusterState(models.TextChoices):
    STARTING = "starting", "Starting"  # images travel, Ray starts
    RUNNING = "running", "Running"  # every member in Ray's node list
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"  # three restarts failed; retried every 15 minutes


class Cluster(models.Model):
    name = models.CharField(max_length=63, unique=True)
    state = models.CharField(max_length=16, choices=ClusterState.choices, default=ClusterState.STARTING)
    network = models.CharField(max_length=64, blank=True, help_text="The cluster's network, as a CIDR subnet")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ClusterMember(models.Model):
    class Role(models.TextChoices):
        HEAD = "head", "Head"
        WORKER = "worker", "Worker"

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="members")
    machine = models.OneToOneField("machines.Machine", on_delete=models.PROTECT, related_name="membership")
    role = models.CharField(max_length=8, choices=Role.choices, default=Role.WORKER)

    def __str__(self) -> str:
        return f"{self.machine} in {self.cluster} ({self.role})"
