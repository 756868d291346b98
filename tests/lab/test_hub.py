"""The lab hub against the real ``huggingface_hub`` client, on 127.0.0.1 (no lab, no namespaces)."""

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.errors import (GatedRepoError, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

from lab import cli, hub_models
from lab.hub import HubServer, read_token_file
from lab.util import LabError

TINY = "fadenstack-lab/tiny-chat"
GATED = "fadenstack-lab/gated-chat"
MEDIUM = "fadenstack-lab/medium-chat"
TOKEN = "hf_lab_valid_token"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = HubServer("127.0.0.1", 0, tokens=[TOKEN], cache_dir=tmp_path_factory.mktemp("hub-cache"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def tiny_snapshot(hub, tmp_path_factory) -> Path:
    return Path(snapshot_download(TINY, endpoint=hub.url, cache_dir=tmp_path_factory.mktemp("hf-cache"),
                                  token=False))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(url: str, headers: dict | None = None, method: str = "GET"):
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.headers, response.read()


def test_model_info_with_files_metadata_describes_the_bytes_the_hub_serves(hub, tiny_snapshot):
    info = HfApi(endpoint=hub.url).model_info(TINY, revision="main", files_metadata=True, token=False)

    assert info.id == TINY and info.gated is False
    assert len(info.sha) == 40 and int(info.sha, 16) >= 0
    assert tiny_snapshot.name == info.sha
    siblings = {sibling.rfilename: sibling for sibling in info.siblings}
    assert set(siblings) == {path.name for path in tiny_snapshot.iterdir()}
    for name, sibling in siblings.items():
        assert sibling.size == (tiny_snapshot / name).stat().st_size
    weights = siblings["model.safetensors"]
    assert weights.lfs.sha256 == sha256_of(tiny_snapshot / "model.safetensors")
    assert weights.lfs.size == weights.size
    assert 60 * 2**20 < weights.size < 70 * 2**20
    assert siblings["config.json"].lfs is None


def test_snapshot_download_gets_a_well_formed_llama_whose_config_matches_its_weights(hub, tiny_snapshot):
    served = hub.store.files(hub_models.MODELS[TINY])
    for name, file in served.items():
        assert (tiny_snapshot / name).read_bytes() == file.local_path.read_bytes(), name

    data = (tiny_snapshot / "model.safetensors").read_bytes()
    header_length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_length])
    header.pop("__metadata__")
    spans = sorted(tuple(entry["data_offsets"]) for entry in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data) - 8 - header_length
    assert all(previous[1] == following[0] for previous, following in zip(spans, spans[1:]))
    for entry in header.values():
        assert entry["dtype"] == "F16"
        assert entry["data_offsets"][1] - entry["data_offsets"][0] == 2 * hub_models.element_count(entry["shape"])

    config = json.loads((tiny_snapshot / "config.json").read_text())
    assert header["model.embed_tokens.weight"]["shape"] == [config["vocab_size"], config["hidden_size"]]
    assert header["model.layers.0.mlp.up_proj.weight"]["shape"] == [config["intermediate_size"],
                                                                     config["hidden_size"]]
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"][0] == (
        config["num_key_value_heads"] * config["hidden_size"] // config["num_attention_heads"])
    assert f"model.layers.{config['num_hidden_layers'] - 1}.input_layernorm.weight" in header
    assert f"model.layers.{config['num_hidden_layers']}.input_layernorm.weight" not in header

    tokenizer = json.loads((tiny_snapshot / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert len(vocab) == 259 <= config["vocab_size"]
    assert vocab["<s>"] == config["bos_token_id"] and vocab["</s>"] == config["eos_token_id"]
    assert "chat_template" in json.loads((tiny_snapshot / "tokenizer_config.json").read_text())
    assert json.loads((tiny_snapshot / "generation_config.json").read_text())["eos_token_id"] == 2


def test_head_gives_the_client_the_lfs_etag_size_and_commit(hub):
    info = HfApi(endpoint=hub.url).model_info(TINY, files_metadata=True, token=False)
    weights = next(sibling for sibling in info.siblings if sibling.rfilename == "model.safetensors")
    metadata = get_hf_file_metadata(hf_hub_url(TINY, "model.safetensors", endpoint=hub.url), token=False)

    assert metadata.etag == weights.lfs.sha256
    assert metadata.size == weights.size
    assert metadata.commit_hash == info.sha
    assert metadata.location == hf_hub_url(TINY, "model.safetensors", endpoint=hub.url)


def test_a_range_request_is_answered_with_206_and_exactly_those_bytes(hub, tiny_snapshot):
    whole = (tiny_snapshot / "model.safetensors").read_bytes()
    url = hf_hub_url(TINY, "model.safetensors", endpoint=hub.url)

    status, headers, body = fetch(url, {"Range": "bytes=1000-4999"})
    assert status == 206
    assert headers["Content-Range"] == f"bytes 1000-4999/{len(whole)}"
    assert body == whole[1000:5000]

    status, headers, body = fetch(url, {"Range": "bytes=-16"})
    assert (status, body) == (206, whole[-16:])

    with pytest.raises(urllib.error.HTTPError) as refused:
        fetch(url, {"Range": f"bytes={len(whole)}-"})
    assert refused.value.code == 416
    assert refused.value.headers["Content-Range"] == f"bytes */{len(whole)}"


def test_a_gated_model_needs_one_of_the_hubs_tokens(hub, tmp_path):
    with pytest.raises(GatedRepoError) as without_token:
        hf_hub_download(GATED, "config.json", endpoint=hub.url, cache_dir=tmp_path / "none", token=False)
    assert without_token.value.response.status_code == 401

    with pytest.raises(GatedRepoError) as wrong_token:
        hf_hub_download(GATED, "config.json", endpoint=hub.url, cache_dir=tmp_path / "wrong", token="hf_no_access")
    assert wrong_token.value.response.status_code == 403

    info = HfApi(endpoint=hub.url).model_info(GATED, token=False)  # the card is public, as on the hub
    assert info.gated == "manual"
    path = Path(snapshot_download(GATED, endpoint=hub.url, cache_dir=tmp_path / "valid", token=TOKEN))
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    weights = hub.store.files(hub_models.MODELS[GATED])["model.safetensors"]
    assert sha256_of(path / "model.safetensors") == weights.sha256


def test_unknown_repos_revisions_and_files_raise_the_clients_own_errors(hub, tmp_path):
    api = HfApi(endpoint=hub.url)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("fadenstack-lab/no-such-model", token=False)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("nobody/nothing", "config.json", endpoint=hub.url, cache_dir=tmp_path, token=False)
    with pytest.raises(RevisionNotFoundError):
        api.model_info(TINY, revision="v9", token=False)
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(TINY, "pytorch_model.bin", endpoint=hub.url, cache_dir=tmp_path, token=False)

    with pytest.raises(urllib.error.HTTPError) as unknown:
        fetch(f"{hub.url}/api/models/nobody/nothing")
    assert (unknown.value.code, unknown.value.headers["X-Error-Code"]) == (404, "RepoNotFound")


def test_list_models_answers_like_the_hub(hub):
    models = list(HfApi(endpoint=hub.url).list_models(token=False))
    assert [model.id for model in models] == [TINY, MEDIUM, GATED]
    _, _, body = fetch(f"{hub.url}/api/models?search=tiny")
    assert [(model["id"], model["modelId"]) for model in json.loads(body)] == [(TINY, TINY)]


def test_the_medium_model_is_about_512_mib_and_is_not_made_until_its_files_are_asked_for(hub):
    plan = hub_models.MODELS[MEDIUM]
    assert 500 * 2**20 < hub_models.safetensors_size(plan) < 530 * 2**20
    header = hub_models.safetensors_header(plan)
    assert len(json.loads(header[8:])) == len(plan.tensor_shapes()) + 1

    info = HfApi(endpoint=hub.url).model_info(MEDIUM, token=False)  # no files_metadata: no sha256 needed
    assert "model.safetensors" in [sibling.rfilename for sibling in info.siblings]
    assert info.used_storage > hub_models.safetensors_size(plan)
    assert not hub.store.model_dir(plan).exists()


def test_the_same_seed_gives_the_same_bytes_in_another_cache(hub, tmp_path):
    plan = hub_models.MODELS[GATED]
    again = hub_models.ModelStore(tmp_path).files(plan)
    served = hub.store.files(plan)
    assert {path: file.sha256 for path, file in again.items()} == {path: file.sha256 for path, file in served.items()}


def test_faden_lab_hub_serves_on_the_address_it_prints_until_interrupted(tmp_path):
    assert cli.build_parser().parse_args(["hub", "--token", "a", "--token", "b"]).tokens == ["a", "b"]
    process = subprocess.Popen(
        [sys.executable, "-m", "lab", "hub", "--bind", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "FADEN_LAB_CACHE": str(tmp_path)}, cwd=Path(__file__).parents[2])
    try:
        url = process.stdout.readline().split()[2]
        assert url.startswith("http://127.0.0.1:")
        _, _, body = fetch(f"{url}/api/models")
        assert TINY in [model["id"] for model in json.loads(body)]
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0  # a loaded host answers a signal late


def test_a_token_file_gives_its_tokens_one_a_line_and_a_missing_or_empty_one_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("hf_lab_one\n\n# a comment\n  hf_lab_two  \n")
    assert read_token_file(str(path)) == ["hf_lab_one", "hf_lab_two"]
    assert cli.build_parser().parse_args(["hub", "--token-file", str(path)]).token_file == str(path)
    path.write_text("\n")
    with pytest.raises(LabError, match="holds no token"):
        read_token_file(str(path))
    with pytest.raises(LabError, match="No such file"):
        read_token_file(str(tmp_path / "missing"))
