"""The Models pages and the cluster page's "Where the machines get models" card, as each role sees them."""
import pytest

from clusters.choices import ModelSource
from console import roles
from console.jobs import job_create
from console.models import Job
from deployments.choices import ModelState
from deployments.models import ModelFile, ModelHolding, StoredModel
from deployments.store import sources
from tests.builders import cluster_of, gpu_machine
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def model():
    model = StoredModel.objects.create(
        repo="org/tiny-chat", commit="c" * 40, state=ModelState.READY, bytes_total=67_000_000, bytes_done=67_000_000,
        facts={"architecture": "LlamaForCausalLM", "parameter_count": 33_500_000, "dtype": "float16", "context_length": 2048,
               "weight_bytes": 67_000_000, "gpu_memory_bytes": 80_400_000, "gpu_memory_rule": "weights + 20 % for the KV cache"})
    ModelFile.objects.create(model=model, path="model.safetensors", size=67_000_000, sha256="a" * 64)
    return model


def signed_in(client, role):
    client.force_login(UserFactory(role=role))
    return client


def test_the_model_page_shows_what_the_files_say_and_where_it_is(client, model):
    machine = gpu_machine("lab-a", 11)
    ModelHolding.objects.create(model=model, machine=machine, bytes=67_000_000, path="/var/lib/x")
    machine_page = signed_in(client, roles.OPERATOR).get(machine.get_absolute_url()).content.decode()
    assert "Models in its store" in machine_page and "org/tiny-chat" in machine_page
    page = client.get(model.get_absolute_url()).content.decode()
    for words in ("LlamaForCausalLM", "33.5 M", "float16", "2048 tokens", "weights + 20 % for the KV cache", "lab-a",
                  "model.safetensors"):
        assert words in page
    assert 'title="lab-a still holds org/tiny-chat' in page  # Delete is greyed out, and says why


def test_a_viewer_sees_the_models_but_no_button_that_works(client, model):
    gpu_machine("lab-a", 11)
    cluster_of([gpu_machine("lab-b", 12)], name="gpu-room")
    page = signed_in(client, roles.VIEWER).get(model.get_absolute_url()).content.decode()
    assert "Copy to gpu-room's machines" in page and "needs an Operator" in page
    listing = signed_in(client, roles.VIEWER).get("/models/").content.decode()
    assert "org/tiny-chat" in listing and "fieldset disabled" in listing
    assert client.post("/models/add/", {"repo": "org/x"}).status_code == 403
    assert not StoredModel.objects.filter(repo="org/x").exists()


def test_the_card_names_the_machines_a_check_found_cut_off_and_keeps_server_copies(client):
    cluster = cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])
    job = job_create(kind=sources.KIND, title="Switch to machine downloads", target_type="cluster", target_id=cluster.pk,
                     steps=sources.SWITCH_SOURCE.step_names)
    Job.objects.filter(pk=job.pk).update(state="failed", error="Not every machine reaches the hub at http://hub: "
                                         "lab-b: no route to host. gpu-room keeps Server copies.")
    page = signed_in(client, roles.OPERATOR).get(cluster.get_absolute_url()).content.decode()
    assert "Where the machines get models" in page and "Server copies" in page
    assert "lab-b: no route to host" in page and "Machines download models themselves" in page


def test_switching_back_to_server_copies_applies_at_once(client):
    cluster = cluster_of([gpu_machine("lab-a", 11)], model_source=ModelSource.MACHINES)
    answer = signed_in(client, roles.OPERATOR).post(f"/deployments/clusters/{cluster.pk}/model-source/", {"model_source": "server"})
    assert answer.status_code == 302
    cluster.refresh_from_db()
    assert cluster.model_source == ModelSource.SERVER
    assert not Job.objects.exists()
