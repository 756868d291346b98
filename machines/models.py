"""Enrolled machines and what they reported about themselves."""
import functools
import re
from collections import Counter

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.urls import reverse

from machines import runtimes, ssh_ca, ssh_rules, validators
from machines.agent import agent_version
from machines.choices import AGENT_PENDING, MACHINE_BADGE, EventKind, InterfaceKind, MachineState, RuntimeChoice
from machines.versions import agent_outdated


class Machine(models.Model):
    name = models.CharField(max_length=63, unique=True, validators=[validators.validate_machine_name])
    address = models.CharField(
        max_length=253, validators=[validators.validate_address], help_text="Where the console reaches it over SSH"
    )
    ssh_port = models.PositiveIntegerField(
        default=22, validators=[MinValueValidator(1), MaxValueValidator(65535), validators.validate_ssh_port]
    )
    ssh_user = models.CharField(max_length=32, default="root", validators=[validators.validate_ssh_user])
    host_key_fingerprint = models.CharField(
        max_length=100, blank=True, validators=[validators.validate_fingerprint], help_text="The pinned host key"
    )
    offered_host_key_fingerprint = models.CharField(
        max_length=100, blank=True, help_text="A key the machine offered that is not (yet) trusted"
    )

    state = models.CharField(max_length=16, choices=MachineState.choices, default=MachineState.HOST_KEY)
    state_reason = models.TextField(blank=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)

    arch = models.CharField(max_length=32, blank=True)
    hostname = models.CharField(max_length=255, blank=True)
    cpu_count = models.PositiveIntegerField(null=True, blank=True)
    memory_mib = models.PositiveBigIntegerField(null=True, blank=True)
    store_path = models.CharField(max_length=255, blank=True)
    store_free_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    store_total_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    # The runtime in use (machines/runtimes.py: the config's driver, else the choice, else Docker, else
    # Podman), kept on the row so that lists and the cluster planner read it without the facts.
    container_runtime = models.CharField(max_length=64, blank=True, help_text="The container runtime in use; empty: none")
    container_runtime_version = models.CharField(max_length=64, blank=True)
    container_runtimes = models.JSONField(
        default=list, blank=True, help_text="Every engine the agent found: [{name, version}]"
    )
    configured_runtime = models.CharField(
        max_length=64, blank=True, help_text="The driver the machine's agent config names (the lab's process), if any"
    )
    runtime_choice = models.CharField(
        max_length=16, choices=RuntimeChoice.choices, default=RuntimeChoice.AUTOMATIC, blank=True,
        help_text="The administrator's choice among the engines found; empty: automatic",
    )
    agent_version = models.CharField(max_length=32, blank=True)
    agent_path = models.CharField(max_length=255, blank=True)
    python_path = models.CharField(max_length=255, blank=True, help_text="The Python the agent runs with")
    facts = models.JSONField(default=dict, blank=True, help_text="The agent's last facts, as it reported them")
    facts_at = models.DateTimeField(null=True, blank=True)

    heartbeat_token_hash = models.CharField(max_length=64, blank=True, db_index=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    # What its heartbeats say of the runtime and Ray (machines/beats.py), so that a change is seen
    # within a beat; empty until an agent that reports it (0.3) beats.
    runtime_beat = models.JSONField(default=dict, blank=True, help_text="The runtime section of its last heartbeat")
    runtime_failing_since = models.DateTimeField(
        null=True, blank=True, help_text="Since when its heartbeats report Ray or the runtime's container down"
    )

    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state", "last_seen"])]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("machines:detail", args=[self.pk])

    @property
    def badge(self) -> str:
        return MACHINE_BADGE[self.state]

    @property
    def agent_latest(self) -> str:
        """The agent version this console ships: what Update agent installs."""
        return agent_version()

    @property
    def agent_outdated(self) -> bool:
        """Its agent is older than the console's (or never reported): the list, the page and the API say so."""
        return agent_outdated(self.agent_version, agent_version())

    @property
    def agent_update_available(self) -> bool:
        """What the list's tag and the page's notice show: an outdated agent on a machine that has one
        (not one waiting for its host key or being enrolled, which gets the current agent anyway)."""
        return self.state not in AGENT_PENDING and self.agent_outdated

    @property
    def agent_over_plain_http(self) -> str:
        """For an agent older than 0.10.0 (which reaches the console over plain HTTP, not TLS to a pinned
        certificate): "allowed" or "refused" as FADEN_AGENT_PLAIN_HTTP says, for the page's notice; else ""."""
        if not self.agent_update_available or not agent_outdated(self.agent_version, "0.10.0"):
            return ""
        return "allowed" if settings.FADEN_AGENT_PLAIN_HTTP else "refused"

    @property
    def runtime(self) -> runtimes.Runtime | None:
        """The container runtime in use, with its version; None when the machine has none."""
        return runtimes.Runtime(self.container_runtime, self.container_runtime_version) if self.container_runtime else None

    def runtimes_found(self) -> list[runtimes.Runtime]:
        """The engines the agent found, as it last reported them."""
        return runtimes.found_in({"container_runtimes": self.container_runtimes})

    def no_runtime(self) -> str:
        """The sentence the pages, the wizard and the services say of this machine when it has no runtime."""
        return runtimes.no_runtime(self.name)

    def accelerator_summary(self) -> str:
        """``8 x H100 80GB``, or ``4 x A100 40GB + 2 x L4`` on a mixed machine; empty without any."""
        return accelerator_summary_of((a.model, 1) for a in self.accelerators.all())


def accelerator_summary_of(counted) -> str:
    """``4 x A100 40GB + 2 x L4`` from (model, count) pairs in the machine's order: what
    ``Machine.accelerator_summary`` says, from rows a query counted."""
    counts: Counter[str] = Counter()
    for model, n in counted:
        counts[short_model(model)] += n
    return " + ".join(f"{n} x {model}" for model, n in counts.items())


@functools.lru_cache(maxsize=256)  # a handful of models, named on every row of every list
def short_model(model: str) -> str:
    """The model as people say it: ``NVIDIA H100 80GB HBM3`` -> ``H100 80GB``, ``NVIDIA A100-SXM4-40GB`` -> ``A100 40GB``."""
    text = re.sub(r"-(SXM\d*|PCIE)-", " ", model, flags=re.IGNORECASE)
    noise = {"NVIDIA", "AMD", "OAM", "SXM", "PCIE"}  # vendor and form factor: the same chip either way
    words = [w for w in text.split() if w.upper() not in noise and not re.match(r"^(HBM|GDDR)", w, re.I)]
    return " ".join(words) or model


class Accelerator(models.Model):
    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="accelerators")
    index = models.PositiveIntegerField()
    vendor = models.CharField(max_length=16)
    model = models.CharField(max_length=128)
    memory_mib = models.PositiveBigIntegerField(null=True, blank=True)
    uuid = models.CharField(max_length=128, blank=True)
    pci_bus_id = models.CharField(max_length=64, blank=True)
    # Processes the console did not start that use this GPU (a person's job), as the agent's last facts or
    # heartbeat read the vendor tool's compute processes (agent 0.9): placement counts such a GPU as taken.
    foreign_pids = models.JSONField(default=list, blank=True)
    foreign_memory_mib = models.PositiveBigIntegerField(null=True, blank=True)  # what they hold, where the tool says

    class Meta:
        ordering = ["machine", "index"]
        constraints = [models.UniqueConstraint(fields=["machine", "index"], name="accelerator_index_unique")]

    def __str__(self) -> str:
        return f"{self.machine.name} #{self.index} {self.model}"

    @property
    def foreign_use(self) -> str:
        """``GPU 3: used by a process the console did not start, pid 4121``; empty when none is."""
        if not self.foreign_pids:
            return ""
        pids = ", ".join(str(pid) for pid in self.foreign_pids)
        many = len(self.foreign_pids) > 1
        memory = f" ({self.foreign_memory_mib} MiB)" if self.foreign_memory_mib else ""
        return (f"GPU {self.index}: used by {'processes' if many else 'a process'} the console did not start, "
                f"{'pids' if many else 'pid'} {pids}{memory}")


class NetworkInterface(models.Model):
    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="interfaces")
    name = models.CharField(max_length=32)
    kind = models.CharField(max_length=16, choices=InterfaceKind.choices)
    mac = models.CharField(max_length=32, blank=True)
    mtu = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=16, blank=True)
    addresses = models.JSONField(default=list, blank=True, help_text="Addresses with prefix: 198.18.1.11/24")
    speed_mbps = models.PositiveIntegerField(null=True, blank=True)
    default_route = models.BooleanField(default=False)
    management = models.BooleanField(default=False, help_text="Carries the console's traffic or the default route")

    class Meta:
        ordering = ["machine", "name"]
        constraints = [models.UniqueConstraint(fields=["machine", "name"], name="interface_name_unique")]

    def __str__(self) -> str:
        return f"{self.machine.name}:{self.name}"

    @property
    def is_vpn(self) -> bool:
        return self.kind == InterfaceKind.VPN


class MachineEvent(models.Model):
    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=16, choices=EventKind.choices)
    message = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["-created_at", "-id"]),  # the dashboard's latest events; pruning by age
            models.Index(fields=["machine", "-created_at", "-id"]),  # a machine's page
        ]

    def __str__(self) -> str:
        return f"{self.machine.name}: {self.message}"


class UserPublicKey(models.Model):
    """A public key a person keeps on their profile: the console signs certificates for it
    (docs/ssh-certificates.md). Validated in ``clean`` (``full_clean`` before every save): one
    accepted OpenSSH public key line (machines/ssh_rules.py), stored as that line, with its fingerprint."""

    user = models.ForeignKey("auth.User", on_delete=models.CASCADE, related_name="ssh_public_keys")
    name = models.CharField(max_length=100, help_text="What its owner calls it: laptop")
    key = models.TextField(help_text="One OpenSSH public key line: ssh-ed25519 AAAA... you@laptop")
    fingerprint = models.CharField(max_length=100, editable=False, help_text="SHA256:..., as ssh-keygen -l prints it")
    added_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["user", "name"]
        constraints = [
            models.UniqueConstraint(fields=["user", "name"], name="user_public_key_name_unique",
                                    violation_error_message="You have a key of this name already: give this one another."),
            models.UniqueConstraint(fields=["user", "fingerprint"], name="user_public_key_unique",
                                    violation_error_message="You have added this key already, under another name."),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.fingerprint})"

    def clean(self) -> None:
        self.name = (self.name or "").strip()
        try:
            parsed = ssh_rules.public_key_parse(self.key, ca_fingerprint=ssh_ca.ca_fingerprint(create=False))
        except ssh_rules.PublicKeyRefused as refused:
            raise ValidationError({"key": refused.message}) from None
        self.key = parsed.line
        self.fingerprint = parsed.fingerprint


class SSHCertificate(models.Model):
    """One certificate the console's SSH certificate authority signed: who for, which key, what for,
    how long. Its id is the certificate's serial, and ids never repeat (PostgreSQL's sequence,
    SQLite's AUTOINCREMENT), so no two certificates share a serial, even once old rows are pruned."""

    user = models.ForeignKey("auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    username = models.CharField(max_length=150, help_text="As it was when signed")
    key_id = models.CharField(max_length=300, blank=True, help_text="fadenstack:<user>:<cluster>:<serial>, as sshd logs it")
    public_key_fingerprint = models.CharField(max_length=100)
    principals = models.JSONField(default=list, blank=True)
    valid_after = models.DateTimeField(null=True, blank=True)
    valid_before = models.DateTimeField(null=True, blank=True)
    signed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["signed_at"])]  # pruning by age

    def __str__(self) -> str:
        return self.key_id or f"certificate {self.pk}"
