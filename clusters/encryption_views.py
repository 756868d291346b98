"""The encryption card's buttons (clusters/encryption.py): Encrypt and Renew certificates."""
from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from clusters import encryption
from clusters.models import Cluster


@require_POST
def cluster_encrypt(request, pk: int):
    cluster = get_object_or_404(Cluster, pk=pk)
    try:
        job = encryption.cluster_encrypt(cluster=cluster, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect(cluster)
    if job is None:
        messages.success(request, f"{cluster.name} starts with TLS between its machines.")
    else:
        messages.success(request, f"Encrypting {cluster.name}: it restarts with certificates, and its models load again.")
    return redirect(cluster)


@require_POST
def cluster_certificates_renew(request, pk: int):
    cluster = get_object_or_404(Cluster, pk=pk)
    try:
        encryption.cluster_certificates_renew(cluster=cluster, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"Renewing the certificates of {cluster.name}: nothing restarts.")
    return redirect(cluster)
