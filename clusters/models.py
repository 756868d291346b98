"""Clusters, the machines in them, the runtime images they run, and measured networks."""
from django.db import models
from django.urls import reverse

from clusters.choices import (CHECK_BADGE, CLUSTER_BADGE, MEMBER_BADGE, CheckOutcome, CheckTrigger, ClusterState, ModelSource,
                              MemberState, Role)


class RuntimeImage(models.Model):
    """One build of the runtime (Ray and the engine together) for one platform, held by the server."""

    name = models.CharField(max_length=100, help_text="NVIDIA x86_64 Runtime")
    version = models.CharField(max_length=32, help_text="2.1.0: clusters ask for a major version (2.x)")
    digest = models.CharField(max_length=71, unique=True, help_text="sha256 of the whole file, hex")
    size_bytes = models.PositiveBigIntegerField()
    chunk_size = models.PositiveIntegerField(default=8 * 1024 * 1024)
    chunk_hashes = models.JSONField(default=list, help_text="sha256 of each chunk, in order: resumes check them")
    arch = models.CharField(max_length=32, help_text="CPU architecture: x86_64, aarch64")
    accelerator_vendor = models.CharField(max_length=16, help_text="nvidia, amd")
    certified = models.BooleanField(default=True)
    path = models.CharField(max_length=500, help_text="The file on the server")
    imported_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["arch", "accelerator_vendor", "-version"]

    def __str__(self) -> str:
        return f"{self.name} {self.version}"

    @property
    def major(self) -> str:
        return self.version.split(".")[0]

    @property
    def platform(self) -> str:
        return f"{self.accelerator_vendor}/{self.arch}"


class Cluster(models.Model):
    name = models.CharField(max_length=63, unique=True)
    state = models.CharField(max_length=16, choices=ClusterState.choices, default=ClusterState.STARTING)
    state_reason = models.TextField(blank=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    network = models.CharField(max_length=64, blank=True, help_text="The cluster's network, as a CIDR subnet")
    runtime_version = models.CharField(max_length=16, default="2", help_text="The runtime's major version")
    ray_port = models.PositiveIntegerField(default=6379)
    model_source = models.CharField(max_length=16, choices=ModelSource.choices, default=ModelSource.SERVER,
                                    help_text="Where its machines get a model's files: for the next model placed")
    start_attempts = models.PositiveIntegerField(default=0)
    next_retry_at = models.DateTimeField(null=True, blank=True)
    restart_attempt = models.PositiveIntegerField(default=0, help_text="The repair restart under way (1 of 3), 0 when none")
    last_status = models.JSONField(default=dict, blank=True, help_text="What Ray and the agents last reported")
    last_status_at = models.DateTimeField(null=True, blank=True)
    # The cluster's own SSH key between its nodes (issue 13): the private half is sealed in console/secrets.py
    # under clusters/node_files.py's name for it, never in this table.
    node_public_key = models.CharField(max_length=255, blank=True, help_text="Public half of the cluster's node-to-node SSH key")
    # /shared (clusters/runners/shared.py): {"method": "nfs" | "sshfs" | "none", "reason": why none, "left_out":
    # [machine names not mounting it]}, as the last start or join found it; {} before the first.
    shared_files = models.JSONField(default=dict, blank=True, help_text="How /shared is shared: the method, and who is left out")
    # Encryption (docs/https-and-trust.md): Ray between the machines with TLS, and the copies behind mutual TLS.
    # New clusters start with both; a cluster from before reads False until Encrypt (clusters/encryption.py).
    ray_tls = models.BooleanField(default=True, help_text="Ray between its machines uses TLS (certificates of the console's authority)")
    model_tls = models.BooleanField(default=True, help_text="Its copies serve over mutual TLS to the gateway and the checks")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("clusters:detail", args=[self.pk])

    @property
    def badge(self) -> str:
        return CLUSTER_BADGE[self.state]

    @property
    def head(self):
        member = next((m for m in self.members.all() if m.role == Role.HEAD), None)
        return member.machine if member else None

    @property
    def head_address(self) -> str:
        """The head's address on the cluster's network: Ray's GCS listens there."""
        member = next((m for m in self.members.all() if m.role == Role.HEAD), None)
        return member.address if member else ""


class ClusterMember(models.Model):
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="members")
    machine = models.OneToOneField("machines.Machine", on_delete=models.PROTECT, related_name="membership")
    role = models.CharField(max_length=8, choices=Role.choices, default=Role.WORKER)
    address = models.CharField(max_length=64, blank=True, help_text="Its address on the cluster's network")
    state = models.CharField(max_length=16, choices=MemberState.choices, default=MemberState.PENDING)
    state_reason = models.TextField(blank=True)
    state_changed_at = models.DateTimeField(auto_now_add=True, null=True)
    rejoin_attempts = models.PositiveIntegerField(default=0, help_text="Repairs that tried to join it again since it was last up")
    runtime_image = models.ForeignKey(RuntimeImage, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    ray_node_id = models.CharField(max_length=64, blank=True)
    accelerators_in_ray = models.PositiveIntegerField(default=0)
    last_status = models.JSONField(default=dict, blank=True, help_text="Its agent's and Ray's last answer")
    added_at = models.DateTimeField(auto_now_add=True, null=True)

    class Meta:
        ordering = ["cluster", "machine__name"]

    def __str__(self) -> str:
        return f"{self.machine} in {self.cluster} ({self.role})"

    @property
    def badge(self) -> str:
        return MEMBER_BADGE[self.state]

    @property
    def image_transfer(self) -> "Transfer | None":
        """The runtime image's way to this machine (from the prefetched transfers when there are)."""
        if self.runtime_image_id is None:
            return None
        digest = self.runtime_image.digest
        return next((t for t in self.transfers.all() if t.digest == digest), None)


class Transfer(models.Model):
    """One content-addressed file on its way to one machine of a cluster: a runtime image today, a
    model's files next. The page draws one bar per transfer, so a machine can show several."""

    member = models.ForeignKey(ClusterMember, on_delete=models.CASCADE, related_name="transfers")
    digest = models.CharField(max_length=71, help_text="sha256 of the whole file, hex")
    what = models.CharField(max_length=200, help_text="The file in words: the runtime image, a model's weights")
    source = models.CharField(max_length=200, blank=True, help_text="the server, or a machine and its address")
    bytes_done = models.PositiveBigIntegerField(default=0)
    bytes_total = models.PositiveBigIntegerField(default=0)
    rate = models.FloatField(default=0, help_text="bytes per second, lately")
    bytes_fetched = models.PositiveBigIntegerField(default=0, help_text="bytes that crossed the network, resends included")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["member", "what"]
        constraints = [models.UniqueConstraint(fields=["member", "digest"], name="transfer_unique")]

    def __str__(self) -> str:
        return f"{self.what} to {self.member.machine}"

    @property
    def percent(self) -> int:
        return int(100 * self.bytes_done / self.bytes_total) if self.bytes_total else 0

    @property
    def complete(self) -> bool:
        return self.bytes_total > 0 and self.bytes_done == self.bytes_total


def head_first(member: ClusterMember) -> tuple[bool, str]:
    """Sort key: the head, then the others by name (the order images and Ray start in)."""
    return (member.role != Role.HEAD, member.machine.name)


class NetworkMeasurement(models.Model):
    """A bandwidth test between two machines on one subnet: what the wizard suggests from."""

    subnet = models.CharField(max_length=64)
    source = models.ForeignKey("machines.Machine", on_delete=models.CASCADE, related_name="+")
    target = models.ForeignKey("machines.Machine", on_delete=models.CASCADE, related_name="+")
    mbps = models.FloatField(null=True, blank=True)
    error = models.TextField(blank=True)
    measured_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["subnet", "source", "target"], name="measurement_unique")
        ]


class HealthCheck(models.Model):
    """One look at a running cluster: what was looked at, what was found, what was done."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="health_checks")
    trigger = models.CharField(max_length=16, choices=CheckTrigger.choices)
    trigger_detail = models.CharField(max_length=200, blank=True, help_text="which machine reconnected, who pressed Check now")
    outcome = models.CharField(max_length=16, choices=CheckOutcome.choices, default=CheckOutcome.RUNNING)
    looked_at = models.JSONField(default=list, help_text="What was asked, in order: Ray on the head, each agent")
    found = models.JSONField(default=list, help_text='Problems: [{"machine", "problem", "text"}]')
    action = models.TextField(blank=True, help_text="What was done about it, in words")
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    first_look = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # A check a heartbeat started: that machine's next heartbeat is its second look's cue (clusters/heartbeats.py).
    beat_machine = models.ForeignKey("machines.Machine", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
                                     help_text="The machine whose heartbeat started this check")

    class Meta:
        ordering = ["-started_at", "-pk"]
        indexes = [models.Index(fields=["cluster", "-started_at"]), models.Index(fields=["started_at"])]  # pages; pruning by age

    def __str__(self) -> str:
        return f"Check of {self.cluster} at {self.started_at:%H:%M:%S}: {self.get_outcome_display()}"

    @property
    def badge(self) -> str:
        return CHECK_BADGE[self.outcome]

    @property
    def seconds(self) -> float | None:
        return (self.finished_at - self.started_at).total_seconds() if self.finished_at else None


class NcclTestState(models.TextChoices):
    RUNNING = "running", "Running"  # the all-reduce runs on the head; rows arrive as sizes finish
    FINISHED = "finished", "Finished"  # every size ran
    STOPPED = "stopped", "Stopped"  # a stop rule ended it early (a slow link, the time limit, someone's abort)
    FAILED = "failed", "Failed"  # the program or the way to the head failed: the message has its words


NCCL_TEST_BADGE = {NcclTestState.RUNNING: "blue", NcclTestState.FINISHED: "green", NcclTestState.STOPPED: "amber",
                   NcclTestState.FAILED: "red"}


class NcclTest(models.Model):
    """One NCCL all-reduce test of a cluster (issue 13): its sweep, the sizes measured so far, and the
    sentence that says how it ended. ``rows``: ``[{"size_bytes", "time_us", "algbw", "busbw"}]`` in
    the order run, written as each size finishes. Kept after the job's row is pruned."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="nccl_tests")
    state = models.CharField(max_length=16, choices=NcclTestState.choices, default=NcclTestState.RUNNING)
    message = models.TextField(blank=True, help_text="The peak, or why it stopped or failed, in words")
    started_by = models.ForeignKey("auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    nodes = models.PositiveIntegerField(default=0)
    gpus = models.PositiveIntegerField(default=0)
    minbytes = models.PositiveBigIntegerField()
    maxbytes = models.PositiveBigIntegerField()
    iters = models.PositiveIntegerField()
    warmup = models.PositiveIntegerField()
    rows = models.JSONField(default=list, blank=True)
    avg_busbw = models.FloatField(null=True, blank=True, help_text="nccl-tests' own average, GB/s, when the run completed")
    job = models.ForeignKey("console.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["-started_at", "-pk"]
        indexes = [models.Index(fields=["cluster", "-started_at"])]
        # One test at a time per cluster, even when two requests race past the service's own check.
        constraints = [models.UniqueConstraint(fields=["cluster"], condition=models.Q(state="running"),
                                               name="nccl_test_one_running")]

    def __str__(self) -> str:
        return f"NCCL test of {self.cluster} at {self.started_at:%H:%M:%S}: {self.get_state_display()}"

    @property
    def badge(self) -> str:
        return NCCL_TEST_BADGE[self.state]

    @property
    def peak(self) -> dict | None:
        """The size with the highest bus bandwidth (the first of equals), None before any size finished."""
        return max(self.rows, key=lambda row: row["busbw"], default=None)


class NodeCertificate(models.Model):
    """A certificate the console signed for a node login of this cluster (machines.SSHCertificate: who,
    which key, until when), and whether it was taken back. A certificate names this cluster's principals
    only (machines/sshd.py), so it is listed, and revoked, here alone (clusters/node_logins.py)."""

    certificate = models.OneToOneField("machines.SSHCertificate", on_delete=models.CASCADE, related_name="node_login")
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="node_certificates")
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey("auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    revoked_reason = models.CharField(max_length=300, blank=True, help_text="Why, in words: who took it back, or what changed")

    class Meta:
        ordering = ["-certificate_id"]
        indexes = [models.Index(fields=["cluster", "revoked_at"])]

    def __str__(self) -> str:
        return f"node login {self.certificate_id} to {self.cluster}"


class NodeSettingsOwed(models.Model):
    """What a machine that left a cluster while away still holds of it: its node settings (the cluster's
    SSH key, authorized key, principals, sshd's trust) and its /shared mount, taken away at its next
    contact (clusters/node_leave.py)."""

    machine = models.OneToOneField("machines.Machine", on_delete=models.CASCADE, related_name="+")
    cluster_name = models.CharField(max_length=63)
    shared = models.BooleanField(default=True, help_text="Its /shared mount or export is to be taken away too")
    recorded_at = models.DateTimeField(auto_now_add=True)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)

    def __str__(self) -> str:
        return f"{self.machine} owes the removal of {self.cluster_name}'s node settings"


class CertificateRole(models.TextChoices):
    NODE = "node", "Ray node"
    COPY = "copy", "Copy server"


class MemberCertificate(models.Model):
    """The certificate the console's authority last issued to a member for one role (console/pki.py): its
    key stays on the machine. ``ray_not_after``: the expiry of the node certificate Ray started with there
    (Ray reads its files at start), which a renewal without a restart does not change."""
    member = models.ForeignKey(ClusterMember, on_delete=models.CASCADE, related_name="certificates")
    role = models.CharField(max_length=8, choices=CertificateRole.choices)
    address = models.CharField(max_length=64, help_text="The address it names")
    serial = models.CharField(max_length=64, help_text="Its serial number, hex")
    issued_at = models.DateTimeField()
    not_after = models.DateTimeField(help_text="When it expires")
    ray_not_after = models.DateTimeField(null=True, blank=True, help_text="When the certificate Ray started with expires")

    class Meta:
        ordering = ["member", "role"]
        constraints = [models.UniqueConstraint(fields=["member", "role"], name="one_certificate_per_member_role")]

    def __str__(self) -> str:
        return f"{self.role} certificate of {self.member.machine} until {self.not_after:%Y-%m-%d}"
