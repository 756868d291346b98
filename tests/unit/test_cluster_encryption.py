"""Encryption (clusters/encryption.py, clusters/certificates.py): certificates issued before Ray starts, for each
machine's address, with keys made on the machine; Encrypt, Renew certificates and the hourly renewal; what the
card and the API say."""
import datetime
import ipaddress

import pytest
from cryptography import x509
from django.core.exceptions import ValidationError
from django.utils import timezone

from clusters import encryption, services, steps, tasks
from clusters.choices import ClusterState
from clusters.models import Cluster, MemberCertificate
from console import live, pki, roles
from console.choices import JobState
from console.models import Job
from tests.builders import build, cluster_of, gpu_machine
from tests.factories import UserFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # the job's threads read the database on their own connections


def node(host: int) -> dict:
    return {"address": f"198.18.1.{host}", "alive": True, "gpus": 8, "node_id": f"node-{host}"}


@pytest.fixture(autouse=True)
def authority(settings, tmp_path):
    settings.FADEN_TLS_DIR = tmp_path / "tls"
    settings.FADEN_SECRETS_KEY_PATH = tmp_path / "secrets.key"
    settings.FADEN_CERT_DAYS = 30


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(live, "push", lambda *args, **kwargs: None)
    monkeypatch.setattr(tasks.cluster_check, "apply_async", lambda *args, **kwargs: None)


def stopped_cluster(tmp_path, **fields) -> Cluster:
    image = build("2.1.0")
    held = tmp_path / "runtime.img"
    held.write_bytes(b"x" * image.size_bytes)
    image.path, image.chunk_hashes = str(held), ["c" * 64]
    image.save()
    return cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=image, state=ClusterState.STOPPED, **fields)


@pytest.fixture
def agents(monkeypatch):
    fakes = FakeAgents({"gpu-a": {"ray": {"alive_nodes": 2, "gpus": 16, "nodes": [node(11), node(12)]}}})
    return fakes.install(monkeypatch)


def run(job: Job) -> Job:
    tasks.cluster_job(job.pk)
    return Job.objects.get(pk=job.pk)


def test_a_start_issues_each_machine_its_certificates_for_its_address_before_ray_starts(quiet, tmp_path, agents):
    cluster = stopped_cluster(tmp_path)

    job = run(services.cluster_start(cluster=cluster))

    assert job.state == JobState.SUCCEEDED, job.error
    step = next(s for s in job.steps if s["name"] == "Issue certificates")
    assert step["state"] == "done" and "Ray node and Copy server for 2 machine(s)" in step["detail"]
    calls = [(name, method) for name, method, _ in agents.calls]
    assert calls.index(("gpu-a", "tls_install")) < calls.index(("gpu-a", "ray_start_head"))
    assert calls.index(("gpu-b", "tls_install")) < calls.index(("gpu-b", "ray_join"))
    ca = x509.load_pem_x509_certificate(pki.ca_pem().encode())
    for name, host in (("gpu-a", 11), ("gpu-b", 12)):
        installed = agents.tls[name]["gpu-room"]["installed"]
        assert sorted(installed) == ["copy", "node"]
        cert = x509.load_pem_x509_certificate(installed["node"]["pem"].encode())
        cert.verify_directly_issued_by(ca)
        assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress) == [
            ipaddress.ip_address(f"198.18.1.{host}"), ipaddress.ip_address("127.0.0.1")]
    rows = MemberCertificate.objects.filter(member__cluster=cluster)
    assert rows.count() == 4
    for row in rows:
        assert datetime.timedelta(days=29) < row.not_after - timezone.now() <= datetime.timedelta(days=30)
    assert all(r.ray_not_after == r.not_after for r in rows if r.role == "node")
    said = encryption.encryption_of(Cluster.objects.get(pk=cluster.pk))
    assert said["ray"] == {"token": True, "tls": True} and said["certificates"]["missing"] == []


def test_a_cluster_without_encryption_gets_no_certificate_and_its_step_says_so(quiet, tmp_path, agents):
    cluster = stopped_cluster(tmp_path, ray_tls=False, model_tls=False)

    job = run(services.cluster_start(cluster=cluster))

    assert job.state == JobState.SUCCEEDED, job.error
    assert next(s for s in job.steps if s["name"] == "Issue certificates")["detail"] == "none: this cluster is not encrypted"
    assert not [c for c in agents.calls if c[1].startswith("tls_")]


def test_a_machine_that_cannot_make_its_key_fails_the_start_naming_it(quiet, tmp_path, agents):
    cluster = stopped_cluster(tmp_path)
    agents.answers["gpu-b"] = {"tls_error": ("not_retryable", "openssl is not installed on this machine: install it")}

    job = run(services.cluster_start(cluster=cluster))

    assert job.state == JobState.FAILED
    assert "gpu-b: openssl is not installed on this machine" in job.error
    assert not [c for c in agents.calls if c[1] in ("ray_start_head", "ray_join")]  # Ray never started without it


def test_encrypt_names_the_machines_whose_agent_is_too_old(quiet, tmp_path):
    cluster = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], ray_tls=False)
    cluster.members.get(machine__name="gpu-b").machine.__class__.objects.filter(name="gpu-b").update(agent_version="0.9.3")

    with pytest.raises(ValidationError) as refused:
        encryption.cluster_encrypt(cluster=cluster)

    assert "gpu-b runs an agent older than 0.10.0" in refused.value.messages[0]
    assert not Cluster.objects.get(pk=cluster.pk).ray_tls


def test_encrypt_restarts_a_running_cluster_with_tls_and_only_records_it_for_a_stopped_one(quiet, tmp_path, agents):
    running = cluster_of([gpu_machine("gpu-a", 11)], ray_tls=False, name="plain")
    viewer = UserFactory(username="viewer-enc", role=roles.VIEWER)
    with pytest.raises(Exception):
        encryption.cluster_encrypt(cluster=running, user=viewer)

    job = encryption.cluster_encrypt(cluster=running)

    assert job.kind == steps.START.kind and job.params["restart"] is True and "Issue certificates" in [s["name"] for s in job.steps]
    running.refresh_from_db()
    assert running.ray_tls and job.title == "Restart plain"
    with pytest.raises(ValidationError, match="already uses TLS"):
        encryption.cluster_encrypt(cluster=running)
    stopped = cluster_of([gpu_machine("gpu-c", 13)], ray_tls=False, name="resting", state=ClusterState.STOPPED)
    assert encryption.cluster_encrypt(cluster=stopped) is None
    stopped.refresh_from_db()
    assert stopped.ray_tls and stopped.state == ClusterState.STOPPED


def test_renewal_gives_new_certificates_without_a_restart_and_keeps_what_ray_started_with(quiet, tmp_path, agents):
    cluster = stopped_cluster(tmp_path)
    run(services.cluster_start(cluster=cluster))
    before = {(r.member_id, r.role): r for r in MemberCertificate.objects.all()}
    assert not encryption.certificates_renew_due()  # fresh: nothing due

    job = run(encryption.cluster_certificates_renew(cluster=Cluster.objects.get(pk=cluster.pk)))

    assert job.state == JobState.SUCCEEDED, job.error
    assert "2 of 2 machine(s) renewed" in job.steps[0]["detail"]
    for row in MemberCertificate.objects.all():
        assert row.serial != before[(row.member_id, row.role)].serial
        assert row.ray_not_after == before[(row.member_id, row.role)].ray_not_after
    assert not [c for c in agents.calls[-8:] if c[1] in ("ray_stop", "ray_start_head", "ray_join", "runtime_stop")]


def test_the_hourly_beat_renews_a_cluster_with_a_third_of_its_certificates_life_left(quiet, tmp_path, agents):
    cluster = stopped_cluster(tmp_path)
    run(services.cluster_start(cluster=cluster))
    MemberCertificate.objects.filter(member__machine__name="gpu-b", role="node").update(
        not_after=timezone.now() + datetime.timedelta(days=9))

    renewed = encryption.certificates_renew_due()

    assert renewed == [cluster.pk]
    assert Job.objects.filter(kind=steps.RENEW.kind, target_id=cluster.pk).count() == 1
    assert encryption.certificates_renew_due() == []  # busy with that renewal: the next hour looks again


def test_the_card_says_off_with_encrypt_for_a_plain_cluster_and_on_with_the_expiry_for_an_encrypted_one(quiet, tmp_path, agents, client):
    client.force_login(UserFactory(username="op-enc", role=roles.OPERATOR))
    plain = cluster_of([gpu_machine("gpu-p", 21)], ray_tls=False, model_tls=False, name="plain")
    page = client.get(plain.get_absolute_url()).content.decode()
    assert "TLS off: not encrypted" in page and 'formaction="/clusters/%d/encrypt/"' % plain.pk in page
    assert "Ray token on" in page

    encrypted = stopped_cluster(tmp_path)
    run(services.cluster_start(cluster=encrypted))
    page = client.get(encrypted.get_absolute_url()).content.decode()
    assert "TLS on" in page and "Valid until" in page and "Renew certificates" in page
    answer = client.get(f"/api/clusters/{encrypted.pk}/").json()["encryption"]
    assert answer["ray"] == {"token": True, "tls": True} and answer["model_traffic"] == {"mutual_tls": True}
    assert answer["certificates"]["days"] == 30 and answer["certificates"]["not_after"]


def test_the_api_encrypts_a_plain_cluster_and_refuses_renewing_one_without_certificates(quiet, api_client, monkeypatch):
    from clusters import services as cluster_services

    started = []
    monkeypatch.setattr(cluster_services, "_restart", lambda cluster, **kw: started.append(kw["reason"]) or None)
    plain = cluster_of([gpu_machine("gpu-q", 31)], ray_tls=False, model_tls=False, name="plain-api")

    refused = api_client.post(f"/api/clusters/{plain.pk}/renew-certificates/")
    assert refused.status_code == 400 and "not encrypted" in refused.json()["message"]
    answer = api_client.post(f"/api/clusters/{plain.pk}/encrypt/")
    assert answer.status_code == 200 and started and "TLS between its machines" in started[0]
    assert api_client.get(f"/api/clusters/{plain.pk}/").json()["encryption"]["ray"]["tls"] is True


def test_the_card_asks_for_a_restart_once_the_certificates_ray_started_with_are_due(quiet, tmp_path, agents, client):
    client.force_login(UserFactory(username="op-due", role=roles.OPERATOR))
    cluster = stopped_cluster(tmp_path)
    run(services.cluster_start(cluster=cluster))
    soon = timezone.now() + datetime.timedelta(days=5)
    MemberCertificate.objects.filter(member__cluster=cluster, role="node").update(ray_not_after=soon)

    said = encryption.encryption_of(Cluster.objects.get(pk=cluster.pk))["certificates"]

    assert said["restart_by"] == soon and said["ray_not_after"] == soon
    page = client.get(cluster.get_absolute_url()).content.decode()
    assert "restart the cluster before then so that Ray reads the renewed ones" in page
