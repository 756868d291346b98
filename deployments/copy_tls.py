"""Model traffic over mutual TLS: each copy serves HTTPS with its machine's copy certificate and accepts only
a client certificate of the console's authority (console/pki.py), which the gateway and the checks present.

- A cluster with ``model_tls`` (every new cluster) starts each copy with TLS (``engine.vllm_command(tls=True)``)
  and records it on the copy (``Copy.tls``): the gateway reads it to call the copy over TLS.
- Before a copy with TLS starts, its machine has a copy certificate: the cluster's start issues it for a
  cluster with ``model_tls`` (clusters/certificates.py, recorded in MemberCertificate, renewed hourly when
  due); ``certificates_ensure`` issues it when the record has none (a cluster encrypted since it started) or
  one due for renewal. The key is made on the machine and never leaves it; the engine takes a renewed
  certificate up without a restart (``--enable-ssl-refresh``).
- **Encrypt model traffic** (``deployments.model_traffic.model_traffic_encrypt``) turns ``model_tls`` on for a cluster started before it
  existed: every deployment with a plain copy is moved on one generation, so the apply job's rollout
  (``rollout.roll``) replaces its copies one at a time, each replacement Serving (behind TLS) before the old
  copy stops: the gateway keeps answering throughout.
- ``client_context``: the ``ssl.SSLContext`` the gateway calls copies with (its client certificate, and only
  the console's authority trusted, the copy's certificate checked against its address).

The gateway imports this module (not the console): it reaches console/pki.py through it, as copy_keys does
console/secrets.py.
"""
from __future__ import annotations

import datetime
import logging
import ssl
from dataclasses import dataclass

from django.db import transaction

from console import pki
from console.offers import Offer
from console.roles import OPERATOR, Action
from machines.versions import agent_outdated

log = logging.getLogger(__name__)

TLS_AGENT = "0.10.0"  # the first agent with tls request|install|status
ROLE = "copy"
ENCRYPT = Action("encrypting a cluster's model traffic", OPERATOR)


class CertificateFailed(Exception):
    """The copy's machine could not get its certificate; the message says why, in words."""


# -- the machines' certificates ----------------------------------------------------------------------


def certificates_ensure(cluster, member) -> str:
    """The machine of ``member`` holds a copy certificate for its cluster address, signed by the console's
    authority and not due for renewal (as clusters/certificates.py recorded it): issued now when not (the
    cluster's start issues it for a cluster with ``model_tls``; a cluster encrypted later gets it here, before
    its first copy behind TLS). Returns what was done, in words.

    Serialised per machine (its member row is locked) so that two copies starting there at once do not each
    make a key for the other's certificate."""
    from clusters import certificates
    from clusters.models import ClusterMember, MemberCertificate
    from console.jobs import JobError

    def held() -> MemberCertificate | None:
        row = MemberCertificate.objects.filter(member=member, role=ROLE).first()
        return row if row and row.address == member.address and not pki.renew_due(row.not_after) else None

    if (row := held()) is not None:
        return f"{member.machine.name} holds its copy certificate until {row.not_after:%Y-%m-%d}"
    if agent_outdated(member.machine.agent_version, TLS_AGENT):
        raise CertificateFailed(f"Copies behind TLS need agent {TLS_AGENT} or newer; {member.machine.name} runs "
                                f"{member.machine.agent_version or 'an unknown one'}: select Update agent on its page.")
    if not member.address:
        raise CertificateFailed(f"{member.machine.name} has no address on the cluster's network for its certificate.")
    with transaction.atomic():
        ClusterMember.objects.select_for_update(no_key=True).filter(pk=member.pk).first()
        if (row := held()) is not None:  # another copy's start issued it meanwhile
            return f"{member.machine.name} holds its copy certificate until {row.not_after:%Y-%m-%d}"
        try:
            until = certificates.member_issue(member, roles=[ROLE], ray_starts=False)[ROLE]
        except (JobError, pki.AuthorityError) as exc:
            raise CertificateFailed(getattr(exc, "message", None) or str(exc)) from None
    return f"{member.machine.name} got its copy certificate, valid until {until:%Y-%m-%d}"


# -- the gateway's side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientContext:
    context: ssl.SSLContext
    not_after: datetime.datetime | None  # of the client certificate: a new value means it was renewed


def client_context() -> ClientContext:
    """The context the gateway (and the bench) calls copies with: the console's client certificate, renewed
    here when it is due, and the authority as the only one trusted. TLS 1.3 only: every engine speaks it."""
    files = pki.client_files()
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(str(files.cert), str(files.key), password=files.password)
    return ClientContext(context=context, not_after=files.not_after)


# -- Encrypt model traffic -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelTraffic:
    """The encryption card's line on model traffic."""

    on: bool  # the cluster's copies start with TLS
    copies: int  # copies that hold room on the cluster
    plain: int  # of them, those still serving without TLS (being replaced, when ``on``)
    offer: Offer  # Encrypt model traffic

    @property
    def words(self) -> str:
        if not self.on:
            return "not encrypted"
        if self.plain:
            return f"moving behind TLS: {self.plain} of {self.copies} cop{'y' if self.copies == 1 else 'ies'} left"
        return "mutual TLS"


def model_traffic(cluster, role) -> ModelTraffic:
    from deployments.choices import HOLDS_ROOM
    from deployments.models import Copy

    rows = Copy.objects.filter(deployment__cluster=cluster, state__in=HOLDS_ROOM)
    copies, plain = rows.count(), rows.filter(tls=False).count()
    offer = ENCRYPT.offer(role)
    if offer.ok and (why := encrypt_refusal(cluster)):
        offer = Offer(False, why)
    return ModelTraffic(on=cluster.model_tls, copies=copies, plain=plain, offer=offer)


def encrypt_refusal(cluster) -> str | None:
    from clusters.choices import ClusterState
    from deployments.store.actions import outdated_agents

    if cluster.model_tls:
        return f"{cluster.name}'s model traffic is encrypted already."
    if cluster.state != ClusterState.RUNNING:
        return f"{cluster.name} is {cluster.get_state_display().lower()}: its copies move behind TLS while it runs."
    return outdated_agents(cluster, needed=TLS_AGENT, what="Copies behind TLS")
