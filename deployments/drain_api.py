"""REST for a machine's drain (mixed into /api/machines/ in config/machine_api.py, since machines import no app
above them): its drain state in the machine's answer, and the Operator's actions, each calling the service the
pages call (deployments/drain.py) with the same refusals (403 for the role, 400 with the product's sentence).

- ``GET /api/machines/<id>/drain/``: the drain, or 404 when the machine is not draining;
- ``POST /api/machines/<id>/drain/`` ``{"plan": {...}}``: Drain, with the plan agreed to;
- ``POST /api/machines/<id>/stop-drain/``: Stop drain;
- ``POST /api/machines/<id>/remove-from-cluster/`` ``{"plan": {...}}``: Remove from cluster (a drain, then the
  machine leaves; on a stopped cluster it only leaves the record: the answer is then the job LEAVE);
- ``POST /api/machines/<id>/cancel-removal/``: Cancel removal (a Stop drain while it still drains).
"""
from django.core.exceptions import ValidationError
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from deployments import drain
from deployments.models import Drain
from machines.api import JobSerializer


class DrainSerializer(serializers.ModelSerializer):
    state_label = serializers.CharField(source="get_state_display", read_only=True,
                                        help_text="Starting the drain, Moving copies, Drained, Leaving the cluster or "
                                                  "Stopping the drain")
    cluster_name = serializers.CharField(source="cluster.name", read_only=True)

    class Meta:
        model = Drain
        fields = ["machine", "cluster", "cluster_name", "state", "state_label", "state_reason", "state_changed_at",
                  "remove", "plan", "job", "started_at"]
        read_only_fields = fields


class DrainStartSerializer(serializers.Serializer):
    plan = serializers.DictField(help_text='The drain plan agreed to: {"moves": [{"copy": id, "to": machine id, '
                                           '"slots": [...]}], "stops": [{"copy": id, "reason": "..."}]}')


class RemoveAnswerSerializer(serializers.Serializer):
    drain = DrainSerializer(allow_null=True, help_text="The drain that empties the machine first (a running cluster)")
    job = JobSerializer(allow_null=True, help_text="The job LEAVE (a stopped cluster: the machine only leaves the record)")


def drain_json(row: Drain | None) -> dict | None:
    return DrainSerializer(row).data if row is not None else None


class MachineDrainActions:
    """A machine's drain: its state in the machine's answer, and Drain, Stop drain, Remove, Cancel removal."""

    def retrieve(self, request, *args, **kwargs):
        response = super().retrieve(request, *args, **kwargs)
        row = Drain.objects.select_related("cluster").filter(machine_id=response.data["id"]).first()
        response.data["drain"] = drain_json(row)
        return response

    def list(self, request, *args, **kwargs):
        response = super().list(request, *args, **kwargs)
        rows = response.data.get("results") if isinstance(response.data, dict) else response.data
        if rows:
            ids = [row["id"] for row in rows]
            drains = {d.machine_id: d for d in Drain.objects.select_related("cluster").filter(machine_id__in=ids)}
            for row in rows:
                row["drain"] = drain_json(drains.get(row["id"]))
        return response

    def _cluster_of(self, machine):
        member = getattr(machine, "membership", None)
        if member is None:
            raise ValidationError(f"{machine.name} is in no cluster: there is nothing to drain.")
        return member.cluster

    @extend_schema(methods=["get"], request=None, responses={200: DrainSerializer})
    @extend_schema(methods=["post"], request=DrainStartSerializer, responses={202: DrainSerializer})
    @action(detail=True, methods=["get", "post"], url_path="drain")
    def drain(self, request, pk=None):
        """GET: the machine's drain (404 when it is not draining). POST: Drain it with the plan agreed to (an
        Operator's action, on a running cluster; not the head): its copies move or stop as the plan says."""
        machine = self.get_object()
        if request.method == "GET":
            row = Drain.objects.select_related("cluster").filter(machine=machine).first()
            if row is None:
                raise Http404(f"{machine.name} is not draining.")
            return Response(drain_json(row))
        data = DrainStartSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        row = drain.drain_start(self._cluster_of(machine), machine, data.validated_data["plan"], user=request.user)
        return Response(drain_json(row), status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: DrainSerializer})
    @action(detail=True, methods=["post"], url_path="stop-drain")
    def stop_drain(self, request, pk=None):
        """Stop drain: the machine leaves Ray and joins again, and copies still on it restart there."""
        row = drain.drain_stop(self.get_object(), user=request.user)
        row = Drain.objects.select_related("cluster").filter(pk=row.pk).first() or row
        return Response(drain_json(row), status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=DrainStartSerializer, responses={202: RemoveAnswerSerializer})
    @action(detail=True, methods=["post"], url_path="remove-from-cluster")
    def remove_from_cluster(self, request, pk=None):
        """Remove from cluster: on a running cluster the machine is drained with the plan agreed to, then leaves
        Ray and the cluster (it stays enrolled); on a stopped cluster it only leaves the record."""
        machine = self.get_object()
        data = DrainStartSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        done = drain.machine_remove(self._cluster_of(machine), machine, data.validated_data["plan"], user=request.user)
        body = {"drain": drain_json(done), "job": None} if isinstance(done, Drain) else \
            {"drain": None, "job": JobSerializer(done).data}
        return Response(body, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: DrainSerializer})
    @action(detail=True, methods=["post"], url_path="cancel-removal")
    def cancel_removal(self, request, pk=None):
        """Cancel removal, while the machine still drains: the drain stops and the machine stays in the cluster."""
        row = drain.removal_cancel(self.get_object(), user=request.user)
        row = Drain.objects.select_related("cluster").filter(pk=row.pk).first() or row
        return Response(drain_json(row), status=status.HTTP_202_ACCEPTED)
