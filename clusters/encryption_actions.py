"""REST for the encryption card's buttons: POST /api/clusters/<id>/encrypt/ and POST
/api/clusters/<id>/renew-certificates/. Refusals are the card's sentences (clusters/encryption.py): 403 for
a Viewer, 400 otherwise. What the card says is ``encryption`` in GET /api/clusters/<id>/ (encryption_api.py)."""
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.decorators import action

from clusters import encryption
from clusters.api import ClusterJobSerializer


class EncryptionActions:
    """The encryption card's buttons on /api/clusters/<id>/."""

    @extend_schema(request=None, responses={202: ClusterJobSerializer, 200: ClusterJobSerializer})
    @action(detail=True, methods=["post"])
    def encrypt(self, request, pk=None):
        """Encrypt: Ray between the machines with TLS. A running cluster restarts with certificates and its
        models load again (202 with the job); a stopped one uses TLS when it starts (200, job null). Every
        machine needs agent 0.10.0: the refusal names those to update."""
        cluster = self.get_object()
        job = encryption.cluster_encrypt(cluster=cluster, user=request.user)
        return self._answer(cluster, job)

    @extend_schema(request=None, responses={202: ClusterJobSerializer})
    @action(detail=True, methods=["post"], url_path="renew-certificates")
    def renew_certificates(self, request, pk=None):
        """Renew certificates now on every machine that is up; nothing restarts (Ray's servers keep the
        certificate they started with until their next start)."""
        cluster = self.get_object()
        job = encryption.cluster_certificates_renew(cluster=cluster, user=request.user)
        return self._answer(cluster, job, started=status.HTTP_202_ACCEPTED)
