"""The NCCL test card's button: start the test (``confirm`` from the dialog while copies serve), say
what happens now or why not, and go back to the cluster's page, whose card then fills in live."""
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from clusters import nccl_tests
from clusters.models import Cluster


@require_POST
def cluster_nccl_test(request, pk: int):
    cluster = get_object_or_404(Cluster.objects.defer("last_status"), pk=pk)
    try:
        nccl_tests.nccl_test_start(cluster=cluster, user=request.user, confirm=request.POST.get("confirm") == "1")
    except nccl_tests.NcclTestConflict as refused:
        messages.error(request, refused.message + (" Select Run the NCCL test again to confirm." if refused.confirm else ""))
    except PermissionDenied as refused:
        messages.error(request, str(refused))
    except ValidationError as refused:
        messages.error(request, " ".join(refused.messages))
    else:
        messages.success(request, f"The NCCL test runs on {cluster.name}: each size appears on the card as it finishes.")
    return redirect(f"{cluster.get_absolute_url()}#cluster-nccl")
