"""Encrypt model traffic: the cluster's copies move behind mutual TLS (copy_tls.py holds the certificates and
the card's words; this module starts the moves, which serving.py's rollout makes, make before break)."""
from __future__ import annotations

import logging

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F

from console import roles
from deployments import copy_tls, serving

log = logging.getLogger(__name__)


def model_traffic_encrypt(cluster, *, user=None) -> list[str]:
    """Encrypt model traffic: new copies start with TLS, and each deployment's plain copies are replaced one at
    a time (a replacement Serving before its old copy stops). Returns the deployments that move."""
    from clusters.lifecycle import cluster_changed, cluster_locked
    from clusters.models import Cluster
    from deployments.choices import HOLDS_ROOM
    from deployments.models import Deployment

    copy_tls.ENCRYPT.offer(roles.acting(user)).check()
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        if why := copy_tls.encrypt_refusal(cluster):
            raise ValidationError(why)
        Cluster.objects.filter(pk=cluster.pk).update(model_tls=True)
        cluster.model_tls = True
        moving = list(Deployment.objects.filter(cluster=cluster, deleting_since__isnull=True, orphaned_at__isnull=True,
                                                copy_rows__state__in=HOLDS_ROOM, copy_rows__tls=False)
                      .distinct().order_by("name"))
        # One generation on: the rollout replaces the older generation's copies, make before break.
        Deployment.objects.filter(pk__in=[d.pk for d in moving]).update(generation=F("generation") + 1)
        for deployment in moving:
            serving.apply_start(deployment, user=user)
        transaction.on_commit(lambda: cluster_changed(cluster, part="cards"))
    log.info("%s: model traffic encrypted by %s; moving %s behind TLS.", cluster.name,
             getattr(user, "username", "the console"), ", ".join(d.name for d in moving) or "nothing")
    return [d.name for d in moving]
