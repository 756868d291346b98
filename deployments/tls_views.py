"""Encrypt model traffic, from the cluster page's Model traffic card (deployments/copy_tls.py does it)."""
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from clusters.models import Cluster
from deployments import model_traffic


@require_POST
def cluster_encrypt_model_traffic(request, pk: int):
    cluster = get_object_or_404(Cluster, pk=pk)
    try:
        moving = model_traffic.model_traffic_encrypt(cluster, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, (f"{cluster.name}'s copies load again behind TLS one at a time, each replacement "
                                   f"serving before the old copy stops: {', '.join(moving)}.") if moving else
                         f"{cluster.name}'s new copies start behind TLS.")
    return redirect(cluster)
