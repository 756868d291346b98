"""Models in the server's store, their files, where copies of the files are held; deployments."""
from fractions import Fraction

from django.db import models
from django.urls import reverse

from deployments.choices import COPY_BADGE, DRAIN_BADGE, MODEL_BADGE, CopyState, DrainState, ModelState, Routing


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


class DeploymentQuerySet(models.QuerySet):
    def shown(self):
        """The deployments the lists, pages and API show: not those whose copies run without a deployment
        (deleted while they could not be stopped; the cluster's page lists them apart)."""
        return self.filter(orphaned_at__isnull=True)


class Deployment(models.Model):
    """A model served on a cluster under the name clients use at the gateway, as a number of copies.

    Every copy runs on one kind of GPU (vendor, model, memory) and one CPU architecture, with the same
    share of GPUs, GPU memory per GPU, context length and engine options. Changing any of those (not
    the number of copies, nor the routing) bumps ``generation``: copies of an older generation are replaced one
    at a time. ``routing`` is the gateway's alone: a change reaches it within a second and restarts nothing.
    """

    name = models.CharField(max_length=63, unique=True, help_text="The name clients use at the gateway")
    cluster = models.ForeignKey("clusters.Cluster", on_delete=models.PROTECT, related_name="deployments")
    model = models.ForeignKey(StoredModel, on_delete=models.PROTECT, related_name="deployments")
    copies = models.PositiveIntegerField(default=1, help_text="How many copies are wanted")
    gpu_quarters = models.PositiveIntegerField(default=4, help_text="GPUs per copy, in quarters of a GPU: 4 is one GPU")
    gpu_vendor = models.CharField(max_length=16)
    gpu_model = models.CharField(max_length=128)
    gpu_memory_mib = models.PositiveBigIntegerField(help_text="Each GPU's memory: with vendor and model, the GPU's kind")
    arch = models.CharField(max_length=32, help_text="The CPU architecture its copies run on")
    memory_per_gpu_mib = models.PositiveBigIntegerField(help_text="The GPU memory a copy may use on each of its GPUs")
    context_length = models.PositiveIntegerField(help_text="The longest request and answer, in tokens")
    engine_options = models.JSONField(default=list, blank=True, help_text="More options for the engine, as its flags")
    routing = models.CharField(max_length=16, choices=Routing.choices, default=Routing.LEAST_BUSY, help_text=(
        "How the gateway picks a copy for a request: the least busy, or the one holding the prompt's prefix in its "
        "cache (changed without restarting any copy)"))
    generation = models.PositiveIntegerField(default=1)
    deleting_since = models.DateTimeField(null=True, blank=True, help_text="Delete was asked: its copies stop, then it goes")
    orphaned_at = models.DateTimeField(null=True, blank=True, help_text=(
        "Deleted while its copies could not be stopped (the cluster could not be reached): they run without a "
        "deployment, hold their GPUs and answer at the gateway until they are taken over (deployments/orphans.py)"))
    created_by = models.ForeignKey("auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = DeploymentQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("deployments:detail", args=[self.pk])

    @property
    def orphaned(self) -> bool:
        """Its copies run without a deployment: it is listed on its cluster's page, not as a deployment."""
        return self.orphaned_at is not None

    @property
    def gpus(self) -> Fraction:
        """GPUs per copy: 1/4, 1/2, 1, 2, 4, ..."""
        return Fraction(self.gpu_quarters, 4)

    @property
    def gpus_label(self) -> str:
        gpus = self.gpus
        return {Fraction(1, 4): "a quarter of a GPU", Fraction(1, 2): "half a GPU"}.get(
            gpus, f"{int(gpus)} GPU{'s' if gpus != 1 else ''}")

    @property
    def kind_label(self) -> str:
        from machines.models import short_model

        return f"{short_model(self.gpu_model)} ({self.arch})"


class Copy(models.Model):
    """One copy of a deployment: an engine on the GPUs of one machine, or of several of one kind.

    ``slots`` is what placement gave it, one per machine: ``[{"machine": id, "gpus": [0, 1],
    "quarters": 4, "port": 8100}]``; the engine starts on the first slot's machine (``machine``), at
    ``address``:``port`` on the cluster's network.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="copy_rows")
    number = models.PositiveIntegerField(help_text="Its number within the deployment, from 1")
    generation = models.PositiveIntegerField(default=1)
    state = models.CharField(max_length=16, choices=CopyState.choices, default=CopyState.QUEUED)
    state_reason = models.TextField(blank=True)
    state_changed_at = models.DateTimeField(null=True, blank=True)
    machine = models.ForeignKey("machines.Machine", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="model_copies", help_text="Where its engine runs")
    slots = models.JSONField(default=list, blank=True)
    address = models.GenericIPAddressField(null=True, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True, help_text="The engine's process, as its machine reports it")
    log_tail = models.TextField(blank=True, help_text="The engine's last lines while it starts or after it failed")
    restarts = models.PositiveIntegerField(default=0)
    api_key_sealed = models.TextField(blank=True, default="", help_text=(
        "The copy's own key (the engine's VLLM_API_KEY), sealed with the secrets key: only the gateway sends it. "
        "Empty for a copy started before copies had keys"))
    agent_key = models.CharField(max_length=63, blank=True, default="", help_text=(
        "Its id on its machine when that is not d<deployment>-c<number>: an engine taken over that no record knew "
        "keeps the id it was started with"))
    tls = models.BooleanField(default=False, help_text=(
        "Its engine serves mutual TLS (the machine's copy certificate; it asks the gateway's and the checks' client "
        "certificate), as it was started"))
    created_at = models.DateTimeField(auto_now_add=True)
    serving_since = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["deployment", "number"]
        constraints = [models.UniqueConstraint(fields=["deployment", "number"], name="copy_number_unique")]

    def __str__(self) -> str:
        return f"{self.deployment.name} #{self.number}"

    @property
    def key(self) -> str:
        """The copy's name on its machine (the agent's copy id)."""
        return self.agent_key or f"d{self.deployment_id}-c{self.number}"

    def placed_on(self, machine_id: int) -> bool:
        """Whether the copy's record places it on the machine (its first machine, or any of its slots')."""
        return self.machine_id == machine_id or any(s.get("machine") == machine_id for s in self.slots or [])

    @property
    def badge(self) -> str:
        return COPY_BADGE.get(self.state, "grey")

    @property
    def url(self) -> str | None:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.address}:{self.port}" if self.address and self.port else None


class EngineSample(models.Model):
    """What one copy's engine said of itself at one health check (its /metrics, deployments/engine_metrics.py),
    kept an hour and a bit for the deployment's charts. Counters are as the engine showed them (since it
    started); the charts take their differences. None: the engine does not show that figure."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="engine_samples")
    copy_pk = models.PositiveBigIntegerField(help_text=(
        "The copy's id, kept after its row goes: a replacement's counters start again from zero"))
    copy_number = models.PositiveIntegerField(help_text="The copy's number within the deployment, for the charts' lines")
    taken_at = models.DateTimeField()
    running = models.FloatField(null=True, blank=True, help_text="Requests in the engine's running batch")
    waiting = models.FloatField(null=True, blank=True, help_text="Requests waiting for a place in it")
    kv_cache = models.FloatField(null=True, blank=True, help_text="Its KV cache in use, 0 to 1")
    prefix_hits = models.FloatField(null=True, blank=True, help_text="Prompt tokens found in its prefix cache (a counter)")
    prefix_queries = models.FloatField(null=True, blank=True, help_text="Prompt tokens looked up in its prefix cache (a counter)")
    generation_tokens = models.FloatField(null=True, blank=True, help_text="Tokens it generated (a counter)")

    class Meta:
        indexes = [models.Index(fields=["deployment", "taken_at"], name="engine_sample_deployment_at")]

    def __str__(self) -> str:
        return f"copy {self.copy_pk} at {self.taken_at:%H:%M:%S}"


class GatewayKey(models.Model):
    """A key clients give the gateway (``Authorization: Bearer fs-...``), stored as its sha256 only.

    The secret is shown once, to whoever created it; ``prefix`` is what lists show of it. A key may be
    limited to some deployments by the names clients use (``deployments``; empty: every one). A revoked
    key stays listed, for the record, and the gateway refuses it within a second.
    """

    name = models.CharField(max_length=100, help_text="What the key is for: a team, an application")
    prefix = models.CharField(max_length=16, help_text="The key's first characters, as lists show it")
    key_hash = models.CharField(max_length=64, unique=True, help_text="The hex sha256 of the secret")
    deployments = models.JSONField(default=list, blank=True,
                                   help_text="The deployment names it may use; empty: every one")
    created_by = models.ForeignKey("auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, help_text="Written by the gateway, at most once a minute")
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey("auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Requests the gateway lets through a minute; empty: no limit (deployments/gateway/limits.py)")
    tokens_per_minute = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Prompt and completion tokens a minute; empty: no limit")

    class Meta:
        ordering = ["-created_at", "-pk"]
        indexes = [models.Index(fields=["revoked_at"], name="gateway_key_revoked")]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


class KeyUsage(models.Model):
    """What one gateway key did in one hour, added up over every gateway process: the gateways count in Redis,
    a beat task copies the hours that changed here (deployments/gateway_usage.py), kept FADEN_KEEP_KEY_USAGE_DAYS.

    ``requests`` were sent on to a copy (``errors`` among them: answers of 500 and above, copies that could not
    be reached); ``refused`` were over the key's limits (429, not sent on). Tokens are the copies' ``usage``."""

    key = models.ForeignKey(GatewayKey, on_delete=models.CASCADE, related_name="usage")
    hour = models.DateTimeField(help_text="The hour's start (UTC)")
    requests = models.PositiveBigIntegerField(default=0)
    errors = models.PositiveBigIntegerField(default=0)
    refused = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["key", "hour"]
        constraints = [models.UniqueConstraint(fields=["key", "hour"], name="key_usage_unique")]
        indexes = [models.Index(fields=["hour"], name="key_usage_hour")]

    def __str__(self) -> str:
        return f"{self.key_id} at {self.hour:%Y-%m-%d %H}:00"


class Drain(models.Model):
    """A machine being drained, or drained (deployments/drain.py): one per machine, while it lasts.

    ``plan`` is the drain plan the person agreed to (deployments/drain_plan.py), as the card showed it:
    ``{"moves": [{"copy": id, "to": machine id}], "stops": [{"copy": id, "reason": "..."}]}``. ``remove``:
    Remove from cluster, so the machine leaves the cluster once drained. While the record is there the
    machine takes no new copy (placement reads it).
    """

    machine = models.OneToOneField("machines.Machine", on_delete=models.CASCADE, related_name="drain")
    cluster = models.ForeignKey("clusters.Cluster", on_delete=models.CASCADE, related_name="drains")
    state = models.CharField(max_length=16, choices=DrainState.choices, default=DrainState.STARTING)
    state_reason = models.TextField(blank=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    remove = models.BooleanField(default=False, help_text="Remove from cluster: the machine leaves once drained")
    plan = models.JSONField(default=dict, blank=True, help_text="The drain plan agreed to")
    job = models.ForeignKey("console.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    started_by = models.ForeignKey("auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    started_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["cluster", "machine__name"]

    def __str__(self) -> str:
        return f"{self.machine} in {self.cluster}: {self.get_state_display()}"

    @property
    def badge(self) -> str:
        return DRAIN_BADGE[self.state]
