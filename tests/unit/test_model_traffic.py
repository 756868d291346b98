"""Model traffic over mutual TLS: a new cluster's copies start behind TLS with a certificate each machine got from
the console's authority (its key made on the machine); Encrypt model traffic moves a plain cluster's copies behind
TLS one at a time, each replacement Serving before its old copy stops; the card and the API say so, and only an
Operator or above may do it."""
import pytest
from cryptography import x509
from django.core.exceptions import PermissionDenied, ValidationError
from django.test import Client
from rest_framework.test import APIClient

from clusters.models import Cluster
from console import pki, roles
from deployments import copy_tls, model_traffic, services
from deployments.choices import CopyState
from tests.factories import UserFactory
from tests.unit.test_deployments import ask, cluster, fakes, model, operator, starts  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_new_cluster_s_copies_start_behind_tls_with_a_certificate_of_the_console_s_authority(cluster, model, fakes,
                                                                                               operator):
    deployment = services.deployment_create(ask=ask(cluster, model, copies=2, gpu_quarters=4, memory_per_gpu_mib=30000),
                                            user=operator)

    copies = list(deployment.copy_rows.order_by("number"))
    assert [(c.state, c.tls) for c in copies] == [(CopyState.SERVING, True)] * 2
    assert copies[0].url.startswith("https://")
    for machine, spec in starts(fakes):
        argv = spec["argv"]
        assert argv[argv.index("--ssl-certfile") + 1] == "/etc/fadenstack/cluster/tls/copy.pem"
        assert argv[argv.index("--ssl-cert-reqs") + 1] == "2"
        held = fakes.tls[machine]["gpu-room"]["installed"]["copy"]
        certificate = x509.load_pem_x509_certificate(held["pem"].encode())
        address = cluster.members.get(machine__name=machine).address
        assert certificate.issuer == pki.ca_certificate().subject and held["ca"] == pki.ca_pem()
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == [address]
    # A machine that holds a certificate not due for renewal is not asked for another.
    requests = [m for m, method, _ in fakes.calls if method == "tls_request"]
    services.deployment_scale(deployment=deployment, copies=3, user=operator)
    again = [m for m, method, _ in fakes.calls if method == "tls_request"]
    assert len(again) - len(requests) <= 1 and set(requests) <= {m for m, _ in starts(fakes)}


def test_encrypt_model_traffic_replaces_a_plain_cluster_s_copies_one_at_a_time_make_before_break(cluster, model, fakes,
                                                                                                 operator):
    Cluster.objects.filter(pk=cluster.pk).update(model_tls=False)  # started before model traffic was encrypted
    cluster.refresh_from_db()
    deployment = services.deployment_create(ask=ask(cluster, model, copies=2, gpu_quarters=4, memory_per_gpu_mib=30000),
                                            user=operator)
    assert list(deployment.copy_rows.values_list("tls", flat=True)) == [False, False]
    assert "--ssl-certfile" not in starts(fakes)[-1][1]["argv"]
    state = copy_tls.model_traffic(cluster, roles.OPERATOR)
    assert (state.words, state.offer.ok) == ("not encrypted", True)

    viewer = UserFactory(username="viewer-tls", role=roles.VIEWER)
    with pytest.raises(PermissionDenied, match="needs an Operator"):
        model_traffic.model_traffic_encrypt(cluster, user=viewer)
    assert copy_tls.model_traffic(cluster, roles.VIEWER).offer.ok is False
    fakes.calls.clear()

    moving = model_traffic.model_traffic_encrypt(cluster, user=operator)

    assert moving == ["chat"]
    order = [(method, kw["copy"]) for _, method, kw in fakes.calls if method in ("copy_start", "copy_stop")]
    key = lambda n: f"d{deployment.pk}-c{n}"  # noqa: E731
    assert order == [("copy_start", key(3)), ("copy_stop", key(1)), ("copy_start", key(4)), ("copy_stop", key(2))]
    assert list(deployment.copy_rows.values_list("number", "state", "tls")) == [
        (3, CopyState.SERVING, True), (4, CopyState.SERVING, True)]
    cluster.refresh_from_db()
    assert cluster.model_tls and copy_tls.model_traffic(cluster, roles.OPERATOR).words == "mutual TLS"
    with pytest.raises(ValidationError, match="encrypted already"):
        model_traffic.model_traffic_encrypt(cluster, user=operator)


def test_the_card_and_the_api_offer_encrypt_model_traffic_to_an_operator(cluster, fakes, operator):
    Cluster.objects.filter(pk=cluster.pk).update(model_tls=False)
    web = Client()
    web.force_login(operator)
    page = web.get(f"/clusters/{cluster.pk}/").content.decode()
    assert f'formaction="/deployments/clusters/{cluster.pk}/encrypt-model-traffic/">Encrypt model traffic</button>' in page
    viewer = Client()
    viewer.force_login(UserFactory(username="viewer-page", role=roles.VIEWER))
    shown = viewer.get(f"/clusters/{cluster.pk}/").content.decode()
    assert "encrypt-model-traffic/" not in shown and "needs an Operator" in shown

    api = APIClient()
    api.force_authenticate(UserFactory(username="viewer-api", role=roles.VIEWER))
    assert api.get(f"/api/clusters/{cluster.pk}/model-traffic/").json()["words"] == "not encrypted"
    refused = api.post(f"/api/clusters/{cluster.pk}/encrypt-model-traffic/")
    assert refused.status_code == 403 and "needs an Operator" in refused.json()["message"]
    api.force_authenticate(operator)
    done = api.post(f"/api/clusters/{cluster.pk}/encrypt-model-traffic/")
    assert done.status_code == 200, done.json()
    assert api.get(f"/api/clusters/{cluster.pk}/model-traffic/").json() == {"on": True, "words": "mutual TLS",
                                                                            "copies": 0, "plain": 0}
    after = web.get(f"/clusters/{cluster.pk}/").content.decode()
    assert "Mutual TLS on" in after and "encrypt-model-traffic/" not in after


def test_a_copy_certificate_due_for_renewal_is_issued_again_before_the_next_copy_starts(cluster, model, fakes, operator,
                                                                                        settings):
    deployment = services.deployment_create(ask=ask(cluster, model, copies=1, gpu_quarters=4, memory_per_gpu_mib=30000),
                                            user=operator)
    requested = lambda: sum(1 for _, method, _ in fakes.calls if method == "tls_request")  # noqa: E731
    before = requested()
    services.deployment_scale(deployment=deployment, copies=2, user=operator)
    assert requested() == before or requested() == before + 1  # a new machine gets one; one that holds it, none
    settings.FADEN_CERT_DAYS = 200  # a third of 200 days is more than the 30 they were signed for: due
    after_scale = requested()
    services.deployment_scale(deployment=deployment, copies=3, user=operator)
    assert requested() == after_scale + 1
