"""The agent reads what a runtime image says of itself from the archive's labels."""
import io
import json
import tarfile

import pytest

from fadenstack_agent import imagearchive
from fadenstack_agent.protocol import AgentError

from tests.agent.imagehelpers import make_image


def archive(tmp_path, members):
    path = tmp_path / "suspect.img"
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_the_labels_of_an_image_archive_are_its_manifest(tmp_path):
    image = make_image(tmp_path, size_mib=1)

    assert imagearchive.read_labels(image["path"]) == {
        "name": "faden-runtime", "version": "2.0.1", "arch": "x86_64", "accelerator_vendor": "none",
        "certified": True, "tag": "localhost/faden-runtime:2.0.1", "image_id": image["manifest"]["image_id"]}
    assert len(image["manifest"]["image_id"]) == 64


INDEX = json.dumps([{"Config": "c.json", "Layers": []}]).encode()


@pytest.mark.parametrize("members, words", [
    ([], "it has no manifest.json"),
    ([("manifest.json", b"{")], "its manifest.json is not valid JSON"),
    ([("manifest.json", b"[]")], "does not name exactly one image"),
    ([("manifest.json", INDEX)], "it has no c.json"),
    ([("manifest.json", INDEX), ("c.json", json.dumps({"config": {"Labels": {}}}).encode())],
     "its labels lack org.fadenstack.runtime.name or org.fadenstack.runtime.version"),
])
def test_an_archive_that_is_not_a_runtime_image_is_refused_in_plain_words(tmp_path, members, words):
    with pytest.raises(AgentError) as refused:
        imagearchive.read_labels(archive(tmp_path, members))

    assert refused.value.kind == "not_retryable"
    assert "suspect.img is not a runtime image: " in refused.value.message and words in refused.value.message


def test_a_file_that_is_not_a_tar_is_refused(tmp_path):
    path = tmp_path / "zeros.img"
    path.write_bytes(b"\0\1" * 4096)
    with pytest.raises(AgentError, match="not a readable tar archive"):
        imagearchive.read_labels(str(path))
