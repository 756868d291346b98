"""The cluster's file-server token: made once and sealed, given to the servers of agents 0.10.0 and later on
stdin, and sent by the fetches from those servers only (an older machine's server keeps serving without)."""
import pytest
from django.db import transaction

from clusters import files_token
from clusters.services import cluster_record_delete
from clusters.choices import ClusterState
from console.models import SealedSecret
from tests.builders import cluster_of, gpu_machine
from tests.fakes import FakeAgents
from tests.unit.test_model_copies import copy, model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


def test_new_agents_servers_require_the_cluster_s_token_and_fetches_send_it_only_to_them(model, monkeypatch):  # noqa: F811
    cluster = cluster_of([gpu_machine("lab-a", 11, agent_version="0.10.0"), gpu_machine("lab-b", 12, agent_version="0.9.0"),
                          gpu_machine("lab-c", 13, agent_version="0.10.0")], state=ClusterState.STOPPED)
    fakes = FakeAgents().install(monkeypatch)
    job = copy(model, cluster)
    assert job.state == "succeeded", job.error

    token = files_token.files_token(cluster)
    assert len(token) >= 40 and token not in SealedSecret.objects.get(name=f"cluster.{cluster.pk}.files_token").sealed
    assert files_token.files_token(cluster) == token                                 # one per cluster, kept
    served = {name: kw.get("token") for name, method, kw in fakes.calls if method == "serve_start"}
    assert served == {"lab-a": token, "lab-b": None, "lab-c": token}
    fetched = {name: (kw["url"], kw["token"]) for name, method, kw in fakes.calls
               if method == "file_fetch" and "2222" in kw["url"]}
    assert fetched["lab-b"] == (f"http://198.18.1.11:7470/blobs/{'2' * 64}", token)  # from lab-a: 0.10.0
    assert fetched["lab-c"] == (f"http://198.18.1.12:7470/blobs/{'2' * 64}", "")     # from lab-b: too old to require it
    assert token not in str(job.__dict__)


def test_the_token_goes_with_the_cluster_s_record():
    cluster = cluster_of([gpu_machine("lab-a", 11)], state=ClusterState.STOPPED)
    files_token.files_token(cluster)
    name = f"cluster.{cluster.pk}.files_token"
    assert SealedSecret.objects.filter(name=name).exists()
    with transaction.atomic():
        cluster_record_delete(cluster=cluster)
    assert not SealedSecret.objects.filter(name=name).exists()
