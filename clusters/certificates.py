"""The cluster's TLS certificates on its machines: issued by the console's authority (console/pki.py) for
each member's cluster address, per role, and renewed before they expire.

A member's key is made on its machine (the agent's ``tls request``) and never leaves it; the console
signs the request for the member's address and the agent installs the certificate beside the key
(``tls install``), with the authority's certificate. One SSH session per member does both. What was
issued, and until when, is recorded in MemberCertificate. docs/https-and-trust.md tells the whole of it.

Roles: ``node`` (Ray's TLS: server and client) when the cluster's Ray uses TLS, ``copy`` (a copy's
HTTPS server) when its copies serve over mutual TLS. Ray reads its files when it starts: a certificate
issued by a start or a join is the one Ray runs with (``ray_not_after``); a renewal changes the files,
which Ray processes started afterwards read, while Ray's servers keep theirs until the next start.
"""
from __future__ import annotations

import datetime
import logging

from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from clusters.fanout import on_member
from clusters.models import CertificateRole, Cluster, ClusterMember, MemberCertificate
from console import pki
from console.jobs import JobError

log = logging.getLogger(__name__)


def roles_of(cluster: Cluster) -> list[str]:
    """The certificates each of the cluster's machines needs: none for a cluster without encryption."""
    return ([CertificateRole.NODE.value] if cluster.ray_tls else []) + ([CertificateRole.COPY.value] if cluster.model_tls else [])


def roles_words(roles: list[str]) -> str:
    return " and ".join(CertificateRole(r).label for r in roles) or "none"


def member_issue(member: ClusterMember, *, roles: list[str], ray_starts: bool) -> dict[str, datetime.datetime]:
    """Issue the member's certificates for ``roles``: a request made on its machine, signed here for its
    cluster address, installed there. ``ray_starts``: Ray starts (or joins) with them next, in the same job.
    Returns when each expires. An agent's failure is a JobError naming the machine; a request the
    authority refuses too (the machine answered something that is not its own key for its address)."""
    cluster = member.cluster

    def issue(agent) -> dict[str, pki.Issued]:
        requests = agent.tls_request(cluster=cluster.name, roles=roles, address=member.address)
        missing = sorted(set(roles) - set(requests))
        if missing:
            raise JobError(f"{member.machine.name} answered no signing request for {', '.join(missing)}.")
        issued = {}
        for role in roles:
            try:
                issued[role] = pki.sign_request(requests[role], address=member.address, role=role, label=cluster.name)
            except pki.CertificateError as exc:
                raise JobError(f"{member.machine.name}: the console's authority refused its {role} certificate request: {exc}") from exc
        agent.tls_install(cluster=cluster.name, ca=pki.ca_pem(), certificates={r: i.pem for r, i in issued.items()})
        return issued

    issued = on_member(member, issue)
    now = timezone.now()
    with transaction.atomic():
        for role, certificate in issued.items():
            defaults = {"address": member.address, "serial": certificate.serial, "issued_at": now,
                        "not_after": certificate.not_after}
            if ray_starts and role == CertificateRole.NODE:
                defaults["ray_not_after"] = certificate.not_after
            MemberCertificate.objects.update_or_create(member=member, role=role, defaults=defaults)
    log.info("Issued %s certificate(s) to %s in %s for %s.", ", ".join(roles), member.machine.name, cluster.name, member.address)
    return {role: c.not_after for role, c in issued.items()}


def renew_due(cluster: Cluster, *, now: datetime.datetime | None = None) -> list[ClusterMember]:
    """The members whose certificates are to be renewed now: one missing for a role the cluster needs, one
    for another address, or one with less than a third of its life left (console/pki.py)."""
    roles = roles_of(cluster)
    if not roles:
        return []
    due = []
    for member in cluster.members.select_related("machine").prefetch_related("certificates"):
        held = {c.role: c for c in member.certificates.all()}
        if any(r not in held or held[r].address != member.address or pki.renew_due(held[r].not_after, now=now) for r in roles):
            due.append(member)
    return due


def expiry(cluster: Cluster) -> dict:
    """When the cluster's certificates expire: the earliest installed (``not_after``), the earliest Ray's
    servers started with (``ray_not_after``), and the machines without one (``missing``)."""
    roles = roles_of(cluster)
    rows = list(MemberCertificate.objects.filter(member__cluster=cluster, role__in=roles).select_related("member__machine"))
    members = list(cluster.members.select_related("machine"))
    have = {(c.member_id, c.role) for c in rows}
    missing = sorted({m.machine.name for m in members for r in roles if (m.pk, r) not in have})
    ray = [c.ray_not_after for c in rows if c.role == CertificateRole.NODE and c.ray_not_after]
    return {"not_after": min((c.not_after for c in rows), default=None), "ray_not_after": min(ray, default=None),
            "missing": missing, "count": len(rows)}


def parse_expiry(text: str) -> datetime.datetime | None:
    """An agent's ISO 8601 expiry (``2027-01-05T19:56:04Z``), aware; None when it is not one."""
    value = parse_datetime(text or "")
    return value if value is not None and value.tzinfo is not None else None
