"""The Node logins card's button: take one certificate back (Administrators), say so, back to the card."""
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from clusters import node_logins
from clusters.models import Cluster


@require_POST
def cluster_node_login_revoke(request, pk: int, serial: int):
    cluster = get_object_or_404(Cluster.objects.defer("last_status"), pk=pk)
    try:
        row = node_logins.node_login_revoke(cluster=cluster, serial=serial, user=request.user)
    except PermissionDenied as refused:
        messages.error(request, str(refused))
    except ValidationError as refused:
        messages.error(request, " ".join(refused.messages))
    else:
        messages.success(request, f"Took back {row.certificate.username}'s node login {row.certificate.key_id}: "
                                  f"{cluster.name}'s machines refuse it from now on.")
    return redirect(f"{cluster.get_absolute_url()}#cluster-node-logins")
