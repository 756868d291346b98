"""The machine page's buttons for what deleted clusters left there: free the runtime images, free
/shared. Each starts a job on the machine (clusters/leftovers.py), or says why not, and goes back to
the machine's page, where the job shows."""
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from clusters import leftovers
from machines.models import Machine


def _start(request, pk: int, service, done: str):
    machine = get_object_or_404(Machine, pk=pk)
    try:
        service(machine=machine, user=request.user)
    except PermissionDenied as refused:
        messages.error(request, str(refused))
    except ValidationError as refused:
        messages.error(request, " ".join(refused.messages))
    else:
        messages.success(request, done.format(name=machine.name))
    return redirect(f"{machine.get_absolute_url()}#machine-leftovers")


@require_POST
def machine_images_free(request, pk: int):
    return _start(request, pk, leftovers.machine_images_free,
                  "Freeing the runtime images on {name}: the job says how much it freed.")


@require_POST
def machine_shared_free(request, pk: int):
    return _start(request, pk, leftovers.machine_shared_free,
                  "Freeing /shared on {name}: the files deleted clusters left there go.")
