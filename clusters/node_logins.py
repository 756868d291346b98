"""Node logins taken back: the certificates signed for a cluster's nodes, listed, and revoked through a key
revocation list that travels with the node settings (docs/ssh-certificates.md, "Taking node logins back").

- ``node_login_record``: inside ``certificate_issue``'s durable transaction, the certificate's row is tied
  to the cluster whose principals it names (``NodeCertificate``): listed on the cluster's page, in its API
  and in the admin, with who, which key, which nodes, until when.
- ``revocation_list(cluster)``: the cluster's KRL (machines/ssh_krl.py): the serials of its certificates
  taken back that have not expired (a day's grace for a machine's clock behind the console's).
- ``node_login_revoke``: an Administrator takes one certificate back (the page's button, the API; an audit
  entry).
- ``node_logins_recheck``: after a user was deactivated, demoted, lost the node-login permission or was
  deleted, every certificate of theirs still valid is taken back.
- Each revocation pushes the cluster's list at once (``revocations_push_later``: a task on commit) to every
  member that answers (the agent's ``node revocations write``, 0.10.0); sshd reads it at every login, so a
  certificate is refused from then on. A member that is away gets it when it comes back
  (``revocations_push_machine``), and with its node settings at every write.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from clusters.fanout import on_every_agent
from clusters.models import Cluster, ClusterMember, NodeCertificate
from console import live, roles
from console.audit import audit_record
from console.choices import AuditOutcome
from console.jobs import task_enqueue
from machines import ssh_ca, ssh_krl, ssh_rules
from machines.choices import MachineState
from machines.models import Machine
from machines.versions import agent_outdated

log = logging.getLogger(__name__)

REVOCATIONS_AGENT = "0.10.0"  # the first agent with node revocations write and RevokedKeys in the drop-in
CLOCK_GRACE = timedelta(days=1)  # an expired certificate stays listed this long: a machine's clock may be behind
REVOKE = roles.Action("taking back a node login", roles.ADMINISTRATOR)
REASON_MAX = 300
LIVE_PART = "node_logins"  # the cluster topic's part that renders the card alone
CARD_ROWS = 20


def node_login_record(*, cluster: Cluster, certificate) -> NodeCertificate:
    """Tie a certificate just signed for ``cluster``'s principals to the cluster (in the signing's transaction)."""
    row = NodeCertificate.objects.create(cluster=cluster, certificate=certificate)
    live.push(f"cluster:{cluster.pk}", part=LIVE_PART)  # the card lists it (sent once the signing commits)
    return row


def node_logins_of(cluster: Cluster, *, limit: int | None = None):
    """The cluster's node-login certificates, newest first, with who and until when."""
    rows = NodeCertificate.objects.filter(cluster=cluster).select_related("certificate", "revoked_by")
    return rows[:limit] if limit else rows


def login_state(row: NodeCertificate, now=None) -> str:
    """``revoked``, ``expired`` or ``valid``, in that order."""
    now = now or timezone.now()
    if row.revoked_at is not None:
        return "revoked"
    before = row.certificate.valid_before
    return "expired" if before is not None and before <= now else "valid"


def _live(rows):
    """Those not taken back that a machine may still accept."""
    return rows.filter(revoked_at__isnull=True, certificate__valid_before__gt=timezone.now() - CLOCK_GRACE)


def revoked_serials(cluster_id: int) -> list[int]:
    return sorted(NodeCertificate.objects.filter(
        cluster_id=cluster_id, revoked_at__isnull=False, certificate__valid_before__gt=timezone.now() - CLOCK_GRACE,
    ).values_list("certificate_id", flat=True))


def revocation_list(cluster: Cluster) -> bytes:
    """The cluster's KRL: its certificates taken back that a machine may still accept, by serial."""
    serials = revoked_serials(cluster.pk)
    now = timezone.now()
    return ssh_krl.krl_bytes(ca_public_key=ssh_ca.ca_public_key(), serials=serials, generated_at=int(now.timestamp()),
                             version=int(now.timestamp() * 1000), comment=f"fadenstack cluster {cluster.name}")


# -- taking them back ------------------------------------------------------------------------------------------


def _revoke(rows, *, by, reason: str) -> list[int]:
    """Mark ``rows`` taken back; the clusters whose list changed. In the caller's transaction."""
    rows = list(rows.select_for_update(of=("self",)).filter(revoked_at__isnull=True))
    if not rows:
        return []
    now = timezone.now()
    NodeCertificate.objects.filter(pk__in=[r.pk for r in rows]).update(
        revoked_at=now, revoked_by=by if by is not None and by.is_authenticated else None, revoked_reason=reason[:REASON_MAX])
    clusters = sorted({r.cluster_id for r in rows})
    for row in rows:
        log.info("Took back the node login certificate %s (serial %s) of cluster %s: %s", row.certificate.key_id,
                 row.certificate_id, row.cluster_id, reason)
    revocations_push_later(clusters)
    for cluster_id in clusters:
        live.push(f"cluster:{cluster_id}", part=LIVE_PART)
    return clusters


def node_login_revoke(*, cluster: Cluster, serial: int, user) -> NodeCertificate:
    """An Administrator takes one certificate of ``cluster`` back: refused for any other role (403), for a
    serial that is not the cluster's (400); one taken back already is answered as it is."""
    REVOKE.offer(roles.acting(user)).check()
    with transaction.atomic():
        row = NodeCertificate.objects.select_related("certificate").filter(cluster=cluster, certificate_id=serial).first()
        if row is None:
            raise ValidationError(f"{cluster.name} has no node login certificate with serial {serial}.")
        if row.revoked_at is None:
            owner = row.certificate.username
            _revoke(NodeCertificate.objects.filter(pk=row.pk), by=user,
                    reason=f"Taken back by {user.get_username()}.")
            audit_record(action="cluster.node_login_revoke", outcome=AuditOutcome.DONE, user=user,
                         target=f"cluster {cluster.name}",
                         message=f"Took back {owner}'s node login certificate {row.certificate.key_id} (serial {serial}).")
            row.refresh_from_db()
    return row


def may_log_in(user) -> bool:
    """Whether ``user`` may still have node-login certificates: an active account whose role and permission allow it."""
    return bool(user.is_active) and ssh_rules.node_login_offer(
        role=roles.acting(user), allowed=roles.node_logins_allowed(user)).ok


def node_logins_recheck(user_ids: Iterable[int], *, why: str = "") -> list[int]:
    """Take back every live certificate of these users who may no longer log in to nodes (deactivated,
    demoted, without the permission, deleted); the clusters whose list changed."""
    user_ids = [pk for pk in set(user_ids) if pk is not None]
    holders = set(_live(NodeCertificate.objects.filter(certificate__user_id__in=user_ids))
                  .values_list("certificate__user_id", flat=True))
    if not holders:
        return []
    changed: list[int] = []
    users = {u.pk: u for u in get_user_model().objects.filter(pk__in=holders)}
    with transaction.atomic():
        for pk in sorted(holders):
            user = users.get(pk)
            if user is not None and may_log_in(user):
                continue
            reason = why or (f"{user.get_username()} may no longer log in to nodes." if user else "The account was deleted.")
            changed += _revoke(_live(NodeCertificate.objects.filter(certificate__user_id=pk)), by=None, reason=reason)
    return sorted(set(changed))


def node_logins_of_deleted_user(user) -> None:
    """The account is being deleted (pre_delete): its certificates go back before the row does."""
    with transaction.atomic():
        _revoke(_live(NodeCertificate.objects.filter(certificate__user_id=user.pk)), by=None,
                reason=f"{user.get_username()}'s account was deleted.")


# -- the push ---------------------------------------------------------------------------------------------------


def revocations_push_later(cluster_ids: Iterable[int]) -> None:
    for cluster_id in sorted(set(cluster_ids)):
        task_enqueue("clusters.tasks.node_revocations_push", cluster_id)


def _targets(members) -> list[Machine]:
    return [m.machine for m in members if m.machine.agent_path and m.machine.state != MachineState.OFFLINE
            and not agent_outdated(m.machine.agent_version, REVOCATIONS_AGENT)]


def revocations_push(cluster: Cluster, *, machines: list[Machine] | None = None) -> dict[str, str]:
    """The cluster's list to each member that answers (or to ``machines``); what failed, by machine name
    (each also a log line: the member gets the list with its node settings, or when it comes back)."""
    members = list(ClusterMember.objects.filter(cluster=cluster).select_related("machine"))
    targets = machines if machines is not None else _targets(members)
    if not targets:
        return {}
    krl = revocation_list(cluster)
    outcomes = on_every_agent(targets, lambda agent: agent.node_revocations_write(cluster=cluster.name, krl=krl))
    failed = {}
    for machine in targets:
        _, error = outcomes[machine.pk]
        if error is not None:
            failed[machine.name] = error.message
            log.warning("%s did not take %s's revocation list: %s", machine.name, cluster.name, error.message)
    log.info("Pushed %s's revocation list (%d serials) to %d of %d machine(s).", cluster.name,
             len(revoked_serials(cluster.pk)), len(targets) - len(failed), len(targets))
    return failed


def revocations_push_machine(machine_id: int) -> None:
    """A member came back: its cluster's list, should it have missed one while away."""
    member = ClusterMember.objects.select_related("cluster", "machine").filter(machine_id=machine_id).first()
    if member is None or not NodeCertificate.objects.filter(cluster=member.cluster, revoked_at__isnull=False).exists():
        return
    targets = _targets([member])
    if targets:
        revocations_push(member.cluster, machines=targets)


# -- what takes node logins back by itself ------------------------------------------------------------------------


def _recheck_on_commit(user_ids: list[int]) -> None:
    transaction.on_commit(lambda: node_logins_recheck(user_ids))


def _on_account_changed(sender, user, changed, **kwargs) -> None:
    if "is_active" in changed and not user.is_active:  # deactivated
        _recheck_on_commit([user.pk])


def _on_role_changed(sender, user, before, after, **kwargs) -> None:
    node_logins_recheck([user.pk])  # sent after the commit already: demoted, or no role any more


def _on_m2m_changed(sender, instance, action, reverse, pk_set, **kwargs) -> None:
    """A group or a permission taken from users (the group "Node logins" from an Operator, say)."""
    if action == "pre_clear" and reverse:
        instance._node_login_users = list(instance.user_set.values_list("pk", flat=True))
    if action not in ("post_remove", "post_clear"):
        return
    if not reverse:
        user_ids = [instance.pk]
    elif action == "post_clear":
        user_ids, instance._node_login_users = getattr(instance, "_node_login_users", []), []
    else:
        user_ids = list(pk_set or ())
    if user_ids:
        _recheck_on_commit(user_ids)


def _on_user_deleted(sender, instance, **kwargs) -> None:
    node_logins_of_deleted_user(instance)


def connect_signals() -> None:
    """Called from the clusters' AppConfig.ready: a user deactivated, demoted, without the node-login
    permission or deleted loses every certificate of theirs at once."""
    from django.db.models.signals import m2m_changed, pre_delete

    from console import accounts

    user_model = get_user_model()
    accounts.account_changed.connect(_on_account_changed, dispatch_uid="clusters.node_logins.account_changed")
    accounts.role_changed.connect(_on_role_changed, dispatch_uid="clusters.node_logins.role_changed")
    for through in (user_model.groups.through, user_model.user_permissions.through):
        m2m_changed.connect(_on_m2m_changed, sender=through, dispatch_uid=f"clusters.node_logins.{through.__name__}")
    pre_delete.connect(_on_user_deleted, sender=user_model, dispatch_uid="clusters.node_logins.user_deleted")


# -- the card ----------------------------------------------------------------------------------------------------



def _machine_ids(principals: list[str]) -> list[int]:
    return [int(p.rsplit("-", 1)[-1]) for p in principals if p.rsplit("-", 1)[-1].isdigit() and "-machine-" in p]


def nodes_named(principals: list[str], cluster_id: int, names: dict[int, str]) -> str:
    """What a certificate opens, in words: every node, or the machines it names (``names``: by machine id)."""
    if principals == [f"fadenstack-cluster-{cluster_id}"]:
        return "every node"
    return ", ".join(names.get(i, f"machine {i}") for i in _machine_ids(principals)) or ", ".join(principals)


def node_logins_card(cluster: Cluster, role) -> dict:
    """The card "Node logins" of the cluster's page: the latest certificates, who, which nodes, until when,
    and Take back (Administrators) on those still valid."""
    now = timezone.now()
    rows = list(node_logins_of(cluster, limit=CARD_ROWS))
    offer = REVOKE.offer(role)
    ids = {i for r in rows for i in _machine_ids(list(r.certificate.principals))}
    names = dict(Machine.objects.filter(pk__in=ids).values_list("pk", "name")) if ids else {}
    return {"node_logins": {
        "rows": [{"row": r, "serial": r.certificate_id, "username": r.certificate.username, "key_id": r.certificate.key_id,
                  "nodes": nodes_named(list(r.certificate.principals), cluster.pk, names), "valid_before": r.certificate.valid_before,
                  "state": login_state(r, now)} for r in rows],
        "offer": offer, "total": NodeCertificate.objects.filter(cluster=cluster).count(),
        "revoked": len(revoked_serials(cluster.pk)),
    }}


__all__ = ["PermissionDenied", "node_login_record", "node_login_revoke", "node_logins_of", "node_logins_recheck",
           "revocation_list", "revocations_push"]
