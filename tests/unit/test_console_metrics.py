"""The console's GET /metrics: refused without the metrics token or an Administrator's session; with either, the
families every app registered, read with prometheus_client's parser, and the figures those of the records."""
import json
import re
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from clusters.choices import CheckOutcome, CheckTrigger, ClusterState
from clusters.models import HealthCheck
from console import roles
from console.choices import JobState
from deployments.choices import CopyState
from deployments.models import Copy
from machines.choices import MachineState
from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model
from tests.factories import JobFactory, UserFactory

pytestmark = pytest.mark.django_db

TOKEN = "console-metrics-" + "t" * 20


@pytest.fixture
def token(settings):
    settings.FADEN_METRICS_TOKEN = TOKEN
    return TOKEN


def families(response) -> dict:
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {family.name: family for family in text_string_to_metric_families(response.content.decode())}


def by(family, *labels: str) -> dict:
    return {tuple(s.labels[label] for label in labels): s.value for s in family.samples}


def test_the_metrics_are_refused_without_the_token_or_an_administrator(client, token):
    anonymous = client.get("/metrics")
    wrong = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}x"})
    client.force_login(UserFactory(username="operator", role=roles.OPERATOR))
    operator = client.get("/metrics")
    posted = client.post("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})

    for refused in (anonymous, wrong):
        assert refused.status_code == 401 and refused["WWW-Authenticate"].startswith("Bearer")
        assert b"fadenstack_" not in refused.content and TOKEN.encode() not in refused.content
    assert b"FADEN_METRICS_TOKEN" in anonymous.content
    assert operator.status_code == 403
    assert operator.content.decode().strip() == "Your role is Operator: reading the console's metrics needs an Administrator."
    assert posted.status_code == 405


def test_a_bearer_is_refused_while_no_token_is_set(client, settings):
    settings.FADEN_METRICS_TOKEN = ""

    refused = client.get("/metrics", headers={"Authorization": "Bearer "})

    assert refused.status_code == 401 and b"only once FADEN_METRICS_TOKEN is set" in refused.content


def test_an_administrator_signed_in_reads_them_without_a_token(admin_client, settings):
    settings.FADEN_METRICS_TOKEN = ""

    found = families(admin_client.get("/metrics"))

    assert by(found["fadenstack_machines"], "state") == {(state.value,): 0 for state in MachineState}


def test_the_figures_are_the_records_machines_clusters_copies_gpus_jobs_and_health_checks(client, token):
    a, b = gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12, accelerators=4, model="NVIDIA A100-SXM4-40GB")
    offline = gpu_machine("gpu-c", 13, accelerators=2, state=MachineState.OFFLINE)
    gpu_machine("gpu-d", 14, accelerators=0, state=MachineState.FAILED)
    a.accelerators.filter(index=7).update(foreign_pids=[4121])  # a person's own job on H100 #7
    b.accelerators.update(memory_mib=40960)
    cluster = cluster_of([a, b, offline])
    cluster_of([gpu_machine("gpu-e", 15, accelerators=0)], name="parked", state=ClusterState.STOPPED)
    llama = deployment_of(cluster, name="llama", copies=3)
    Copy.objects.create(deployment=llama, number=1, state=CopyState.SERVING, machine=a,
                        slots=[{"machine": a.pk, "gpus": [0, 1], "quarters": 4, "port": 8100}])
    Copy.objects.create(deployment=llama, number=2, state=CopyState.STARTING, machine=a,
                        slots=[{"machine": a.pk, "gpus": [2], "quarters": 1, "port": 8101}])
    Copy.objects.create(deployment=llama, number=3, state=CopyState.QUEUED)  # no place: holds nothing
    qwen = deployment_of(cluster, ready_model("org/qwen"), name="qwen")
    Copy.objects.create(deployment=qwen, number=1, state=CopyState.SERVING, machine=a,
                        slots=[{"machine": a.pk, "gpus": [2], "quarters": 2, "port": 8102}])
    Copy.objects.create(deployment=qwen, number=2, state=CopyState.STOPPED, machine=offline,
                        slots=[{"machine": offline.pk, "gpus": [0], "quarters": 4, "port": 8100}])
    JobFactory(kind="machine.refresh", state=JobState.RUNNING, target_id=a.pk)
    JobFactory(kind="machine.refresh", state=JobState.SUCCEEDED, target_id=a.pk)
    JobFactory(kind="deployment.apply", state=JobState.QUEUED, target_id=llama.pk)
    now = timezone.now()
    for outcome, minutes_ago in ((CheckOutcome.REPAIR, 5), (CheckOutcome.REPAIR, 50), (CheckOutcome.HEALTHY, 10),
                                 (CheckOutcome.REPAIR, 90)):
        check = HealthCheck.objects.create(cluster=cluster, trigger=CheckTrigger.SCHEDULE, outcome=outcome)
        HealthCheck.objects.filter(pk=check.pk).update(started_at=now - timedelta(minutes=minutes_ago))

    found = families(client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}))

    assert by(found["fadenstack_machines"], "state") == {
        **{(state.value,): 0 for state in MachineState}, ("healthy",): 3, ("offline",): 1, ("failed",): 1}
    assert by(found["fadenstack_clusters"], "state") == {
        **{(state.value,): 0 for state in ClusterState}, ("running",): 1, ("stopped",): 1}
    copies = by(found["fadenstack_copies"], "deployment", "state")
    assert len(copies) == 2 * len(CopyState) and sum(copies.values()) == 5
    assert copies[("llama", "serving")] == copies[("llama", "starting")] == copies[("llama", "queued")] == 1
    assert copies[("qwen", "serving")] == copies[("qwen", "stopped")] == 1 and copies[("llama", "failed")] == 0
    # H100s: 8 on gpu-a (2 whole + a quarter and a half of #2 held, #7 another's), 2 on the offline gpu-c. A100s: 4 free.
    assert by(found["fadenstack_gpus"], "kind", "status") == {
        ("H100 80GB", "held"): 2.75, ("H100 80GB", "other"): 1, ("H100 80GB", "free"): 4.25,
        ("H100 80GB", "unavailable"): 2, ("A100 40GB", "held"): 0, ("A100 40GB", "other"): 0,
        ("A100 40GB", "free"): 4, ("A100 40GB", "unavailable"): 0}
    assert by(found["fadenstack_jobs"], "kind", "state") == {
        ("machine.refresh", "running"): 1, ("machine.refresh", "succeeded"): 1, ("deployment.apply", "queued"): 1}
    assert by(found["fadenstack_health_checks_last_hour"], "outcome") == {
        **{(outcome.value,): 0 for outcome in CheckOutcome}, ("repair",): 2, ("healthy",): 1}
    for family in found.values():
        assert family.type == "gauge" and family.name.startswith("fadenstack_")


def test_a_scrape_costs_a_few_queries_whatever_the_records(client, token, django_assert_max_num_queries):
    cluster = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)])
    for n in range(5):
        deployment = deployment_of(cluster, ready_model(f"org/m{n}"), name=f"m{n}")
        Copy.objects.create(deployment=deployment, number=1, state=CopyState.SERVING,
                            slots=[{"machine": cluster.members.first().machine_id, "gpus": [n], "quarters": 4}])

    # jobs; machines; clusters, health checks; copies, deployments; the GPUs, the copies holding them
    with django_assert_max_num_queries(8):
        families(client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}))


def test_the_grafana_dashboard_asks_only_for_series_the_gateway_and_the_console_answer(client, token):
    from pathlib import Path

    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from deployments.gateway.answer import Answer
    from deployments.gateway.metrics import GatewayMetrics
    from deployments.gateway.routes import RouteTable, Snapshot

    table = RouteTable()
    table.apply(Snapshot(deployments=(("llama", 1, 0),), copies=((7, 1, 1, "a", 1, "t"),), keys=()))
    gateway = GatewayMetrics(table)
    answer = Answer(None)
    answer.status, answer.first_at = 200, 1.0
    gateway.record("llama", answer, 0.5, False)
    gateway.refused("model_not_found")
    registry = CollectorRegistry()
    registry.register(gateway)
    deployment_of(cluster_of([gpu_machine("gpu-a", 11)]), name="llama")
    JobFactory()
    answered = {s.name for text in (generate_latest(registry).decode(),
                                    client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).content.decode())
                for family in text_string_to_metric_families(text) for s in family.samples}
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-fadenstack.json").read_text())

    asked = set(re.findall(r"fadenstack_[a-z_]+", json.dumps(dashboard)))

    assert len(asked) >= 15 and asked <= answered, asked - answered
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "fadenstack"
