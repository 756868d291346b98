"""REST for what deleted clusters left on a machine: POST /api/machines/<id>/free-images/ and
/free-shared/ (mixed into /api/machines/ in config/machine_api.py, since machines import no cluster) start the jobs the machine page's buttons start (clusters/leftovers.py), with the same
refusals (403 for the role, 400 with the sentence while a cluster on the machine uses them)."""
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.response import Response

from clusters import leftovers
from machines.api import JobSerializer


class MachineLeftoversActions:
    """Freeing a machine's runtime images and a former head's /shared: actions of the machines' viewset."""

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"], url_path="free-images")
    def free_images(self, request, pk=None):
        """Remove the runtime images deleted clusters left in the machine's store (all but the one a started
        runtime runs); refused while a cluster that is not stopped runs on the machine."""
        job = leftovers.machine_images_free(machine=self.get_object(), user=request.user)
        return Response(JobSerializer(job).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"], url_path="free-shared")
    def free_shared(self, request, pk=None):
        """Delete the files a deleted cluster left in the machine's /shared; refused while the machine is in a cluster."""
        job = leftovers.machine_shared_free(machine=self.get_object(), user=request.user)
        return Response(JobSerializer(job).data, status=status.HTTP_202_ACCEPTED)
