"""The encryption card and its actions: Encrypt (Ray's TLS between the machines), Renew certificates, the
hourly renewal before they expire, and what the card and the cluster's API say (``encryption_of``).

Ray: token authentication always; TLS when ``Cluster.ray_tls`` (new clusters; Encrypt turns it on for a
cluster from before, by restarting it with certificates: "Issue certificates" before Ray starts). Model
traffic: mutual TLS when ``Cluster.model_tls`` (its line and Encrypt model traffic belong to the copies'
side, deployments). The certificates: clusters/certificates.py; the authority: console/pki.py.
"""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from clusters import certificates, selectors, services, steps
from clusters.actions import busy_refusal
from clusters.choices import ClusterState
from clusters.lifecycle import cluster_changed, cluster_locked
from clusters.models import Cluster
from console import pki, roles
from console.jobs import job_start
from console.models import Job
from console.offers import ALLOWED, Offer
from console.roles import OPERATOR, Action
from machines.versions import version_key

ENCRYPT = Action("encrypting a cluster's traffic", OPERATOR)
ENCRYPT_MODEL_TRAFFIC = Action("encrypting a cluster's model traffic", OPERATOR)  # deployments/copy_tls.py does it
RENEW = Action("renewing a cluster's certificates", OPERATOR)
TLS_AGENT = "0.10.0"  # the agent that makes keys and installs certificates (tls request|install|status)
RENEWAL_WORDS = ("Renewing makes a new key and certificate on every machine while everything runs. Ray reads its "
                 "certificate when it starts: Ray's running servers keep theirs until the cluster's next start, while "
                 "Ray processes started from now on, and machines that join, use the new one (both are trusted, signed "
                 "by the same authority).")


def old_agents(cluster: Cluster) -> list[str]:
    """The cluster's machines whose agent cannot make keys yet (older than 0.10.0), by name."""
    needed = version_key(TLS_AGENT)
    return sorted(m.machine.name for m in cluster.members.select_related("machine")
                  if (version_key(m.machine.agent_version or "") or ((0,), 0)) < needed)


def _update_words(names: list[str]) -> str:
    one = len(names) == 1
    return (f"{', '.join(names)} {'runs' if one else 'run'} an agent older than {TLS_AGENT}, which cannot make keys: select "
            f"Refresh facts on {'its' if one else 'their'} page to update {'it' if one else 'them'}, then Encrypt.")


def encryption_actions(cluster: Cluster, busy: Job | None, *, role: roles.Role | None) -> dict[str, Offer]:
    """Encrypt and Renew certificates for ``role`` now, allowed or refused with the sentence that says why."""
    name, label = cluster.name, cluster.get_state_display()

    def offer(action: Action, refusal: str, what: str) -> Offer:
        permitted = action.offer(role)
        if not permitted.ok:
            return permitted
        if refusal:
            return Offer(False, refusal)
        if busy is not None:
            return Offer(False, busy_refusal(cluster, busy, what))
        return ALLOWED

    encrypt_refusal = ""
    if cluster.ray_tls:
        encrypt_refusal = f"Ray in {name} already uses TLS."
    elif cluster.state in (ClusterState.STOPPING, ClusterState.DELETING):
        encrypt_refusal = f"{name} is {label}."
    elif old := old_agents(cluster):
        encrypt_refusal = _update_words(old)
    renew_refusal = ""
    if not certificates.roles_of(cluster):
        renew_refusal = f"{name} is not encrypted: it has no certificates to renew."
    elif cluster.state != ClusterState.RUNNING:
        renew_refusal = f"{name} is {label}: its next start issues new certificates."
    # Encrypt model traffic (the copies' side: deployments/copy_tls.py checks the same again when it acts).
    model_refusal = ""
    if cluster.model_tls:
        model_refusal = f"{name}'s model traffic is encrypted already."
    elif cluster.state != ClusterState.RUNNING:
        model_refusal = f"{name} is {label.lower()}: its copies move behind TLS while it runs."
    elif old := old_agents(cluster):
        model_refusal = _update_words(old).replace(", then Encrypt.", ", then Encrypt model traffic.")
    model_permitted = ENCRYPT_MODEL_TRAFFIC.offer(role)
    return {"encrypt": offer(ENCRYPT, encrypt_refusal, "Encrypt it"),
            "renew": offer(RENEW, renew_refusal, "Renew its certificates"),
            "encrypt_model_traffic": model_permitted if not model_permitted.ok else
            (Offer(False, model_refusal) if model_refusal else ALLOWED)}


def _offers(cluster: Cluster, user) -> dict[str, Offer]:
    return encryption_actions(cluster, selectors.cluster_busy(cluster), role=roles.acting(user))


def cluster_encrypt(*, cluster: Cluster, user=None) -> Job | None:
    """Encrypt: Ray between the machines with TLS from now on. A running cluster restarts with
    certificates (its models load again); a stopped one uses TLS when it starts."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        _offers(cluster, user)["encrypt"].check()
        cluster.ray_tls = True
        cluster.save(update_fields=["ray_tls"])
        if cluster.state == ClusterState.STOPPED:
            cluster_changed(cluster)
            return None
        return services._restart(cluster, user=user, reason="Encrypting: restarting the cluster and its models with TLS "
                                                             "between its machines.")


def cluster_certificates_renew(*, cluster: Cluster, user=None) -> Job:
    """Renew certificates now, on every machine that is up; nothing restarts (``RENEWAL_WORDS``)."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        _offers(cluster, user)["renew"].check()
        job = job_start(kind=steps.RENEW.kind, title=f"Renew the certificates of {cluster.name}", target_type="cluster",
                        target_id=cluster.pk, steps=steps.RENEW.step_names, user=user)
        cluster_changed(cluster)
        return job


def certificates_renew_due(*, now=None) -> list[int]:
    """The hourly beat: every running, encrypted cluster with a certificate that has less than a third of
    its life left (or a machine without one) gets a renewal, unless an operation is under way (the next
    hour tries again). The ids of the clusters renewed."""
    renewed = []
    for cluster in Cluster.objects.filter(state=ClusterState.RUNNING).exclude(ray_tls=False, model_tls=False):
        if not certificates.renew_due(cluster, now=now):
            continue
        try:
            cluster_certificates_renew(cluster=cluster)
        except ValidationError:
            continue  # busy, or no longer running: the next hour looks again
        renewed.append(cluster.pk)
    return renewed


# -- what the card and the API say ----------------------------------------------------------------


def encryption_of(cluster: Cluster) -> dict:
    """The truth for the card and the API: Ray's token and TLS, model traffic, when the certificates expire."""
    expiry = certificates.expiry(cluster)
    ray_until = expiry["ray_not_after"]
    restart_by = ray_until if ray_until and pki.renew_due(ray_until) else None
    return {
        "ray": {"token": True, "tls": cluster.ray_tls},
        "model_traffic": {"mutual_tls": cluster.model_tls},
        "certificates": {"roles": certificates.roles_of(cluster), "not_after": expiry["not_after"],
                         "ray_not_after": ray_until, "missing": expiry["missing"], "days": pki.cert_days(),
                         "restart_by": restart_by},
    }


def encryption_card(cluster: Cluster, role: roles.Role | None) -> dict:
    """The card's context: ``encryption_of``, the actions, and the job that issues or renews certificates
    (a start, a join, a repair or a renewal under way; else the last renewal)."""
    busy = selectors.cluster_busy(cluster)
    job = busy if busy is not None and busy.kind in (steps.RENEW.kind, steps.START.kind, steps.ADD.kind, steps.REJOIN.kind) else None
    if job is None:
        job = Job.objects.filter(target_type="cluster", target_id=cluster.pk, kind=steps.RENEW.kind).order_by("-pk").first()
    return {"encryption": encryption_of(cluster) | {"actions": encryption_actions(cluster, busy, role=role), "job": job,
                                                     "renewal_words": RENEWAL_WORDS, "now": timezone.now(),
                                                     "agent": TLS_AGENT}}
