"""What models running without a deployment add to /api/clusters/ (config/cluster_api.py composes it): the
orphans of a cluster, Look for them, and Take over one (keep or delete). Same services as the card; refusals are
400s in their own words (console.api's handler turns the services' ValidationError into them), 403 for a role
(Operator)."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from console import roles
from deployments import orphans


class OrphanEngineSerializer(serializers.Serializer):
    machine = serializers.CharField(source="machine_name", help_text="The machine the engine runs on")
    copy = serializers.CharField(help_text="Its id on the machine (the agent's copy id)")
    pid = serializers.IntegerField(allow_null=True, help_text="The engine's process, as its machine reported it")
    gpus = serializers.ListField(child=serializers.IntegerField(), allow_null=True,
                                 help_text="The GPU indices it holds on the machine; null when the machine does not say")
    port = serializers.IntegerField(allow_null=True)
    since = serializers.CharField(allow_null=True, help_text="When it started serving, or its engine started")
    healthy = serializers.BooleanField(help_text="It answered its health check when last asked")


class OrphanSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="The name it answers under at the gateway (take-over's name)")
    model = serializers.CharField()
    known = serializers.BooleanField(help_text="A record of the console knows its copies (a deployment deleted while "
                                               "they could not be stopped); false: found by a look, no record knew it")
    since = serializers.CharField(allow_null=True)
    gpus = serializers.IntegerField(help_text="The GPUs its engines hold")
    engines = OrphanEngineSerializer(many=True)
    keep_refusal = serializers.CharField(allow_null=True, help_text="Why it cannot be kept (only delete then); null when it can")


class OrphanLookSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    state = serializers.CharField()
    finished_at = serializers.DateTimeField(allow_null=True)
    not_asked = serializers.ListField(child=serializers.CharField(), help_text="Machines the look could not ask, with why")


class OrphansSerializer(serializers.Serializer):
    orphans = OrphanSerializer(many=True)
    last_look = OrphanLookSerializer(allow_null=True)


class OrphanTakeSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200, help_text="The model's name, as the orphans list gives it")
    keep = serializers.BooleanField(help_text="true: keep it as a deployment, its copies as they run (same processes); "
                                              "false: delete it properly (its engines stopped, its GPUs free)")


class OrphanJobSerializer(serializers.Serializer):
    job = serializers.IntegerField(help_text="The job that carries it out (its state: GET /api/jobs/<id>/)")
    detail = serializers.CharField()


class OrphanActions:
    """``GET .../orphans/``, ``POST .../orphans/look/`` and ``POST .../orphans/take-over/``."""

    @extend_schema(request=None, responses={200: OrphansSerializer})
    @action(detail=True, methods=["get"], url_path="orphans")
    def orphans(self, request, pk=None):
        """The models running on the cluster without a deployment: those records know, and the engines no record
        knows that the last look found; with the last look itself."""
        cluster = self.get_object()
        look = orphans.last_look(cluster)
        found = [{"name": o.name, "model": o.model, "known": o.known, "since": str(o.since) if o.since else None,
                  "gpus": o.gpus, "keep_refusal": o.keep_refusal,
                  "engines": [{"machine_name": e.get("machine_name", ""), "copy": e["copy"], "pid": e.get("pid"),
                               "gpus": e.get("gpus"), "port": e.get("port"), "since": e.get("since"),
                               "healthy": bool(e.get("healthy"))} for e in o.engines]}
                 for o in orphans.orphans_of(cluster)]
        last = {"job": look.pk, "state": look.state, "finished_at": look.finished_at,
                "not_asked": look.params.get("not_asked") or []} if look else None
        return Response(OrphansSerializer({"orphans": found, "last_look": last}).data)

    @extend_schema(request=None, responses={202: OrphanJobSerializer})
    @action(detail=True, methods=["post"], url_path="orphans/look")
    def orphans_look(self, request, pk=None):
        """Look for them (an Operator's action): a job asks every machine of the cluster which engines it runs."""
        job = orphans.orphans_look_start(cluster=self.get_object(), user=request.user)
        return Response({"job": job.pk, "detail": job.title}, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=OrphanTakeSerializer, responses={202: OrphanJobSerializer})
    @action(detail=True, methods=["post"], url_path="orphans/take-over")
    def orphans_take_over(self, request, pk=None):
        """Take over a model running without a deployment (an Operator's action): keep it (a deployment again,
        its copies as they run, not restarted) or delete it properly (engines stopped, GPUs free)."""
        cluster = self.get_object()
        orphans.TAKE_OVER.offer(roles.acting(request.user)).check()  # the role first: a Viewer gets 403, not 400
        data = OrphanTakeSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        job = orphans.orphan_take_over(cluster=cluster, name=data.validated_data["name"],
                                       keep=data.validated_data["keep"], user=request.user)
        return Response({"job": job.pk, "detail": job.title}, status=status.HTTP_202_ACCEPTED)
