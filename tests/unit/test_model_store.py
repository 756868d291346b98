"""The server's model store against the lab hub on 127.0.0.1 with the real huggingface_hub: download,
digests, facts, resume, room, gated models, import and delete (no lab, no namespaces)."""
import io
import threading
from collections import namedtuple
from pathlib import Path

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.management import CommandError, call_command

from console import roles
from console.jobs import job_run
from console.models import Job
from deployments.choices import ModelState
from deployments.models import ModelFile, ModelHolding, StoredModel
from deployments.store import disk, downloads, hub, services
from lab import hub_models
from lab.hub import HubServer
from tests.factories import MachineFactory, UserFactory

TINY = "fadenstack-lab/tiny-chat"
GATED = "fadenstack-lab/gated-chat"
TOKEN = "hf_lab_store_token_1234"

pytestmark = pytest.mark.django_db(transaction=True)  # the bar is written from a thread of its own


@pytest.fixture(scope="module")
def lab_hub(tmp_path_factory):
    log = io.StringIO()
    server = HubServer("127.0.0.1", 0, tokens=[TOKEN], cache_dir=hub_models.default_cache_dir(), log=log)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def hub_url(lab_hub, settings, tmp_path):
    settings.FADEN_HF_ENDPOINT = lab_hub.url
    settings.DATA_DIR = tmp_path / "data"
    lab_hub.log.seek(0)
    lab_hub.log.truncate()
    return lab_hub.url


@pytest.fixture
def operator():
    return UserFactory(role=roles.OPERATOR)


def run_download(model: StoredModel) -> Job:
    job = Job.objects.filter(target_type="model", target_id=model.pk).first()
    job_run(job.pk, lambda ctx: downloads.model_download_run(ctx, model_id=model.pk), on_change=lambda j: None)
    model.refresh_from_db()
    job.refresh_from_db()
    return job


def test_a_model_downloads_into_the_store_with_every_file_checked_and_its_facts_read(hub_url, operator):
    model = services.model_add(repo=TINY, user=operator)
    job = run_download(model)

    assert (model.state, job.state) == (ModelState.READY, "succeeded"), job.error
    listing = hub.listing(TINY, "main", token=None)
    assert model.commit == listing.commit and model.bytes_done == model.bytes_total == listing.size
    rows = {f.path: f for f in model.files.all()}
    assert set(rows) == {f.path for f in listing.files}
    weights = next(f for f in listing.files if f.path.endswith(".safetensors"))
    assert rows[weights.path].sha256 == weights.sha256  # the hub's LFS digest, checked
    assert len(rows[weights.path].chunk_hashes) == -(-weights.size // disk.CHUNK_SIZE)
    assert disk.blob_path(weights.sha256).stat().st_size == weights.size
    tree = disk.tree_dir(TINY, model.commit)
    assert (tree / "config.json").samefile(disk.blob_path(rows["config.json"].sha256))
    facts = model.facts
    assert facts["architecture"] == "LlamaForCausalLM"
    assert facts["parameter_count"] * 2 == facts["weight_bytes"]  # float16 weights, counted from the headers
    assert facts["gpu_memory_bytes"] > facts["weight_bytes"] and facts["context_length"] > 0
    assert not disk.downloads_dir(model.pk).exists()


def test_the_same_model_twice_is_refused_and_a_bad_repo_id_is_named(hub_url, operator):
    StoredModel.objects.create(repo=TINY, state=ModelState.READY)
    with pytest.raises(ValidationError, match="has fadenstack-lab/tiny-chat already"):
        services.model_add(repo=TINY, user=operator)
    with pytest.raises(ValidationError, match="is not a repository id"):
        services.model_add(repo="../etc/passwd", user=operator)
    with pytest.raises(PermissionDenied, match="needs an Operator"):
        services.model_add(repo="org/other", user=UserFactory(role=roles.VIEWER))


def test_a_gated_model_without_a_token_fails_with_the_sentence_that_says_so(hub_url, operator, monkeypatch):
    monkeypatch.setattr(downloads, "hf_token", lambda: None)
    model = services.model_add(repo=GATED, user=operator)
    job = run_download(model)
    assert model.state == ModelState.FAILED
    assert "is a gated model: the hub asks for a token" in model.state_reason
    assert job.error == model.state_reason and job.error_kind == "not_retryable"

    monkeypatch.setattr(downloads, "hf_token", lambda: "hf_not_the_right_one")
    services.model_retry(model, user=operator)
    run_download(model)
    assert "The server's Hugging Face token has no access to fadenstack-lab/gated-chat" in model.state_reason
    assert "hf_not_the_right_one" not in model.state_reason

    monkeypatch.setattr(downloads, "hf_token", lambda: TOKEN)
    services.model_retry(model, user=operator)
    job = run_download(model)
    assert model.state == ModelState.READY, job.error
    assert TOKEN not in job.log + job.error + str(model.facts)


def test_a_model_too_big_for_the_store_is_refused_before_a_byte_is_written(hub_url, operator, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 3_100_000, 3_100_000))
    model = services.model_add(repo=TINY, user=operator)
    run_download(model)
    assert model.state == ModelState.FAILED
    assert model.state_reason.startswith("Needs 67.") and model.state_reason.endswith("; 3.1 MB are free.")
    assert not list(disk.blobs_dir().iterdir())


def test_a_file_that_does_not_match_the_hubs_digest_is_removed_and_the_download_fails(hub_url, operator, monkeypatch):
    real = hub.listing

    def lying(repo, revision, *, token):
        found = real(repo, revision, token=token)
        files = tuple(f._replace(sha256="0" * 64) if f.sha256 else f for f in map(_as_tuple, found.files))
        return hub.HubListing(repo=found.repo, revision=found.revision, commit=found.commit, gated=found.gated,
                              files=tuple(hub.HubFile(**f._asdict()) for f in files))

    monkeypatch.setattr(hub, "listing", lying)
    model = services.model_add(repo=TINY, user=operator)
    job = run_download(model)
    assert model.state == ModelState.FAILED
    assert "model.safetensors does not match the hub: its sha256 is" in job.error
    assert not any(disk.blobs_dir().glob("*" + "0" * 10 + "*"))


def _as_tuple(f: hub.HubFile):
    return namedtuple("F", "path size sha256 blob_id")(f.path, f.size, f.sha256, f.blob_id)


def test_a_download_resumes_from_the_partial_file_it_left(hub_url, lab_hub, operator):
    model = services.model_add(repo=TINY, user=operator)
    listing = hub.listing(TINY, "main", token=None)
    weights = next(f for f in listing.files if f.path.endswith(".safetensors"))
    source = disk.blob_path(weights.sha256)  # the bytes, taken from a first full download
    first = run_download(model)
    assert first.state == "succeeded"
    whole = source.read_bytes()
    ModelFile.objects.filter(model=model).update(sha256="")
    source.unlink()
    StoredModel.objects.filter(pk=model.pk).update(state=ModelState.FAILED)
    partial = disk.downloads_dir(model.pk) / f"{weights.sha256}.part"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(whole[: len(whole) // 2])
    lab_hub.log.seek(0)
    lab_hub.log.truncate()

    services.model_retry(model, user=operator)
    job = run_download(model)
    assert model.state == ModelState.READY, job.error
    requests = [line for line in lab_hub.log.getvalue().splitlines() if weights.path in line and "GET" in line]
    assert requests and all('" 206 ' in line for line in requests), requests  # only the rest was asked for
    assert disk.blob_path(weights.sha256).read_bytes() == whole


def test_import_takes_a_directory_with_the_same_checks_and_delete_frees_the_store(hub_url, operator, tmp_path):
    from huggingface_hub import snapshot_download

    snapshot = Path(snapshot_download(TINY, endpoint=hub_url, cache_dir=tmp_path / "hf", token=False))
    out = io.StringIO()
    call_command("models", "import", str(snapshot), "--repo", "local/tiny", stdout=out)
    model = StoredModel.objects.get(repo="local/tiny")
    assert model.state == ModelState.READY and "Imported local/tiny" in out.getvalue()
    assert model.facts["architecture"] == "LlamaForCausalLM"
    assert (snapshot / "config.json").exists()  # the source stays as it was
    with pytest.raises(CommandError, match="holds no config.json"):
        call_command("models", "import", str(tmp_path), "--repo", "local/empty")

    holding = ModelHolding.objects.create(model=model, machine=MachineFactory(name="lab-x"))
    with pytest.raises(ValidationError, match="lab-x still holds local/tiny's files"):
        services.model_delete(model, user=operator)
    holding.delete()
    services.model_delete(model, user=operator)
    assert not StoredModel.objects.exists() and not list(disk.blobs_dir().iterdir())
    assert not disk.tree_dir("local/tiny", model.commit).exists()
