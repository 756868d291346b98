"""Models in the server's store, their files, where copies of the files are held; deployments."""
from django.db import models
from django.urls import reverse

from deployments.choices import MODEL_BADGE, ModelState


class StoredModel(models.Model):
    """One revision of a Hugging Face repository, in the server's store (or on its way there)."""

    repo = models.CharField(max_length=200, help_text="The repository's id on the hub: org/name")
    revision = models.CharField(max_length=200, default="main", help_text="A branch, tag or commit, as asked")
    commit = models.CharField(max_length=64, blank=True, help_text="The commit the revision named when it was added")
    state = models.CharField(max_length=16, choices=ModelState.choices, default=ModelState.DOWNLOADING)
    state_reason = models.TextField(blank=True)
    imported_from = models.CharField(max_length=1000, blank=True, help_text="A directory on the server, for an import")
    bytes_total = models.PositiveBigIntegerField(default=0)
    bytes_done = models.PositiveBigIntegerField(default=0)
    rate = models.FloatField(default=0, help_text="bytes per second, lately")
    facts = models.JSONField(default=dict, blank=True, help_text="What config.json and the weights' headers say")
    created_by = models.ForeignKey("auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["repo", "revision"]
        constraints = [models.UniqueConstraint(fields=["repo", "revision"], name="stored_model_unique")]
        verbose_name = "model"

    def __str__(self) -> str:
        return self.repo if self.revision == "main" else f"{self.repo}@{self.revision}"

    def get_absolute_url(self) -> str:
        return reverse("models:detail", args=[self.pk])

    @property
    def badge(self) -> str:
        return MODEL_BADGE.get(self.state, "grey")

    @property
    def percent(self) -> int:
        return int(100 * self.bytes_done / self.bytes_total) if self.bytes_total else 0

    @property
    def seconds_left(self) -> float | None:
        if self.state != ModelState.DOWNLOADING or self.rate <= 0 or not self.bytes_total:
            return None
        return max(self.bytes_total - self.bytes_done, 0) / self.rate


class ModelFile(models.Model):
    """One file of a model: where the server keeps it (by its sha256) and how machines check it."""

    model = models.ForeignKey(StoredModel, on_delete=models.CASCADE, related_name="files")
    path = models.CharField(max_length=1000, help_text="Its path in the repository: model.safetensors")
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64, blank=True, help_text="Empty until the file is in the store")
    chunk_size = models.PositiveIntegerField(default=0)
    chunk_hashes = models.JSONField(default=list, blank=True, help_text="sha256 of each chunk, for resumes")
    hub_digest = models.CharField(max_length=64, blank=True, help_text="What the hub says: LFS sha256 or git blob id")

    class Meta:
        ordering = ["model", "path"]
        constraints = [models.UniqueConstraint(fields=["model", "path"], name="model_file_unique")]

    def __str__(self) -> str:
        return f"{self.model} {self.path}"


class ModelHolding(models.Model):
    """A machine's store holds every file of a model (its agent placed it and said so)."""

    model = models.ForeignKey(StoredModel, on_delete=models.CASCADE, related_name="holdings")
    machine = models.ForeignKey("machines.Machine", on_delete=models.CASCADE, related_name="model_holdings")
    bytes = models.PositiveBigIntegerField(default=0)
    path = models.CharField(max_length=1000, blank=True, help_text="The model's directory on the machine")
    placed_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model", "machine"]
        constraints = [models.UniqueConstraint(fields=["model", "machine"], name="model_holding_unique")]

    def __str__(self) -> str:
        return f"{self.model} on {self.machine}"


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
