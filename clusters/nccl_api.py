"""REST for the NCCL test (issue 13): POST /api/clusters/<id>/tests/ starts one, GET lists them newest
first, GET /api/clusters/<id>/tests/<test_id>/ reads one (its sizes so far while it runs), and
``last_test`` in GET /api/clusters/<id>/ is the newest.

Refusals are the rules' sentences (clusters/nccl_tests.py): 403 for a Viewer, 400 while not every
machine is Up, 409 while a test runs on the cluster, and 409 with ``confirm: true`` while copies
serve and the request did not confirm (send ``{"confirm": true}`` to run it anyway).
"""
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.response import Response

from clusters import nccl_tests
from clusters.models import NcclTest, NcclTestState
from console import params


class NcclRowSerializer(serializers.Serializer):
    size_bytes = serializers.IntegerField()
    time_us = serializers.FloatField(help_text="One all-reduce of this size, µs (the better of out of place and in place)")
    algbw = serializers.FloatField(help_text="Algorithm bandwidth, GB/s: bytes over time")
    busbw = serializers.FloatField(help_text="Bus bandwidth, GB/s: what the links carried, as nccl-tests computes it")


class NcclPeakSerializer(serializers.Serializer):
    size_bytes = serializers.IntegerField()
    busbw = serializers.FloatField()


class NcclTestSerializer(serializers.ModelSerializer):
    cluster = serializers.IntegerField(source="cluster_id")
    state = serializers.ChoiceField(choices=NcclTestState.choices)
    message = serializers.CharField(help_text="The peak, or why the test stopped or failed, in words; empty while it runs")
    started_by = serializers.SerializerMethodField(help_text="The username of whoever started it")
    rows = NcclRowSerializer(many=True, help_text="Each size as it finished, smallest first")
    peak = serializers.SerializerMethodField()
    job = serializers.IntegerField(source="job_id", allow_null=True)

    class Meta:
        model = NcclTest
        fields = ["id", "cluster", "state", "message", "started_by", "started_at", "finished_at", "nodes", "gpus",
                  "minbytes", "maxbytes", "iters", "warmup", "rows", "peak", "avg_busbw", "job"]

    def get_started_by(self, test) -> str | None:
        return test.started_by.get_username() if test.started_by else None

    @extend_schema_field(NcclPeakSerializer(allow_null=True))
    def get_peak(self, test) -> dict | None:
        peak = test.peak
        return {"size_bytes": peak["size_bytes"], "busbw": peak["busbw"]} if peak else None


class JSONBooleanField(serializers.BooleanField):
    """true or false as JSON writes them: DRF's own would also take 0, 1, "yes" or "on", which the schema
    (a boolean) does not describe."""

    default_error_messages = {"invalid": "Must be true or false."}

    def to_internal_value(self, data):
        if isinstance(data, bool):
            return data
        self.fail("invalid")


class NcclTestStartSerializer(serializers.Serializer):
    confirm = JSONBooleanField(default=False, help_text="Run it although copies serve on the cluster's GPUs")


class NcclTestRefusedSerializer(serializers.Serializer):
    message = serializers.CharField()
    detail = serializers.CharField(help_text="The same sentence")
    confirm = serializers.BooleanField(help_text="true: copies serve; sending confirm: true runs the test anyway")


def last_test(cluster) -> dict | None:
    """``last_test`` of the cluster's detail: its newest test, or null."""
    test = NcclTest.objects.select_related("started_by").filter(cluster=cluster).first()
    return NcclTestSerializer(test).data if test else None


class NcclTestActions:
    """The cluster viewset's NCCL test actions (config/cluster_api.py mixes them in)."""

    @extend_schema(methods=["GET"], request=None, responses={200: NcclTestSerializer(many=True)})
    @extend_schema(methods=["POST"], request=NcclTestStartSerializer,
                   responses={201: NcclTestSerializer, 409: NcclTestRefusedSerializer})
    @action(detail=True, methods=["get", "post"], url_path="tests")
    def tests(self, request, pk=None):
        """GET: the cluster's NCCL tests, newest first. POST: start one (Administrators and Operators):
        an all-reduce across every GPU of every node, 1 MiB up to FADEN_NCCL_TEST_MAX_BYTES, stopped
        after FADEN_NCCL_TEST_LIMIT_SECONDS or after 5 sizes on a slow link; GET the test for its sizes."""
        cluster = self.get_object()
        if request.method == "GET":
            tests = NcclTest.objects.select_related("started_by").filter(cluster=cluster)
            page = self.paginate_queryset(tests)
            return self.get_paginated_response(NcclTestSerializer(page, many=True).data)
        data = NcclTestStartSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            test = nccl_tests.nccl_test_start(cluster=cluster, user=request.user, confirm=data.validated_data["confirm"])
        except nccl_tests.NcclTestConflict as refused:
            why = refused.message + (" Send confirm: true to run it anyway." if refused.confirm else "")
            return Response({"message": why, "detail": why, "confirm": refused.confirm}, status=status.HTTP_409_CONFLICT)
        return Response(NcclTestSerializer(test).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        parameters=[OpenApiParameter("test_id", int, OpenApiParameter.PATH, description="The test's id")],
        request=None, responses={200: NcclTestSerializer},
    )
    @action(detail=True, methods=["get"], url_path=r"tests/(?P<test_id>[0-9]{1,19})")
    def test(self, request, pk=None, test_id=None):
        """One NCCL test: its sizes so far while it runs, its peak and the sentence it ended with."""
        cluster = self.get_object()
        # An id past the key's range names no test, as a path id past it matches no URL (console.params.IdConverter).
        test_id = int(test_id)
        test = NcclTest.objects.select_related("started_by").filter(cluster=cluster, pk=test_id).first() \
            if 1 <= test_id <= params.ID_MAX else None
        if test is None:
            raise NotFound(f"{cluster.name} has no NCCL test {test_id}.")
        return Response(NcclTestSerializer(test).data)
