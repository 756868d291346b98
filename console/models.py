"""The console's own rows: the job every long operation writes, the audit trail, and the sealed secrets."""
from django.db import models
from django.utils import timezone

from console.choices import AUDIT_BADGE, JOB_ACTIVE, JOB_BADGE, AuditOutcome, JobState
from console.roles import GRANTS, ROLES


class Job(models.Model):
    kind = models.CharField(max_length=64, help_text="What runs, as app.action: machine.enrol")
    title = models.CharField(max_length=200, help_text="What the administrator reads: Enrol lab-a")
    target_type = models.CharField(max_length=32, help_text="The kind of object the job acts on")
    target_id = models.BigIntegerField()
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.QUEUED)
    params = models.JSONField(default=dict, blank=True, help_text="What the task needs beyond its target")
    steps = models.JSONField(default=list, blank=True, help_text="[{name, state, detail}] in order")
    error = models.TextField(blank=True)
    error_kind = models.CharField(max_length=32, blank=True)
    log = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False)
    worker = models.CharField(max_length=200, blank=True)
    created_by = models.ForeignKey(
        "auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    beat_at = models.DateTimeField(null=True, blank=True, help_text="Last sign of life of the worker")
    resumes = models.PositiveIntegerField(default=0, help_text="Times a new worker took it up after one died")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["target_type", "target_id", "-created_at"]),
            models.Index(fields=["state"]),
            models.Index(fields=["-created_at", "-id"]),  # the dashboard's latest jobs; pruning by age
        ]

    def __str__(self) -> str:
        return f"{self.title} ({self.get_state_display()})"

    @property
    def is_active(self) -> bool:
        return self.state in JOB_ACTIVE

    @property
    def badge(self) -> str:
        return JOB_BADGE[self.state]

    @property
    def duration(self):
        if self.started_at and self.finished_at:
            return self.finished_at - self.started_at
        return None


class AuditEntry(models.Model):
    """One thing a person (or a command on the server) did or tried: who, when, what, from where, the outcome.

    Written by console/audit.py only; never changed, deleted by age (FADEN_KEEP_AUDIT_DAYS).
    """

    at = models.DateTimeField(default=timezone.now)
    user = models.ForeignKey("auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    username = models.CharField(max_length=150, blank=True, help_text="As it was then; for a failed sign-in, the name tried")
    action = models.CharField(max_length=100, help_text="What was done: a page's or the API's url name, or login.failed")
    method = models.CharField(max_length=10, blank=True)
    target = models.CharField(max_length=300, blank=True, help_text="What it was done to: the path, a user, a token's owner")
    address = models.GenericIPAddressField(null=True, blank=True, help_text="Where the request came from")
    outcome = models.CharField(max_length=16, choices=AuditOutcome.choices)
    status = models.PositiveSmallIntegerField(null=True, blank=True, help_text="The HTTP status answered")
    message = models.TextField(blank=True, help_text="The words the person read, or what changed")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(fields=["-at", "-id"]),  # the page, newest first; pruning by age
            models.Index(fields=["username", "-at"]),
            models.Index(fields=["outcome", "-at"]),
        ]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.username or 'someone'} {self.action} ({self.outcome})"

    @property
    def badge(self) -> str:
        return AUDIT_BADGE[self.outcome]


class Access(models.Model):
    """What the roles' permissions hang on (console/roles.py): ``console.read``, ``console.operate``,
    ``console.administer``, and the grants on top of a role (``console.node_login``). It has no
    table; Django needs a model to give a permission to."""

    class Meta:
        managed = False
        default_permissions = ()
        permissions = [(role.codename, role.description) for role in ROLES] + [
            (grant.codename, grant.description) for grant in GRANTS]
        verbose_name_plural = "access"


class SealedSecret(models.Model):
    """A secret the console keeps (the Hugging Face token), encrypted with a key kept outside the database.

    Written and read by console/secrets.py only; what a page or the API says of one is whether it is set.
    """

    name = models.CharField(max_length=100, unique=True, help_text="What the secret is for: huggingface.token")
    sealed = models.TextField(help_text="The value, encrypted (Fernet) with the key in FADEN_SECRETS_KEY_PATH")
    changed_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.name
