"""The lab's layer writer: gzip by default, zstd for the big layers of the image Podman loads; either
way the diff id is the sha256 of the uncompressed tar, which is what the engines check."""
import hashlib
import io
import shutil
import subprocess
import tarfile

import pytest

from lab import archive


def uncompressed(path) -> bytes:
    data = path.read_bytes()
    if data[:4] == b"\x28\xb5\x2f\xfd":
        return subprocess.run(["zstd", "-q", "-d", "-c"], input=data, capture_output=True, check=True).stdout
    import gzip
    return gzip.decompress(data)


@pytest.mark.parametrize("compression, magic", [("gzip", b"\x1f\x8b"), ("zstd", b"\x28\xb5\x2f\xfd")])
def test_a_layer_is_compressed_as_asked_and_its_diff_id_is_the_uncompressed_tars(tmp_path, compression, magic):
    if compression == "zstd" and not shutil.which("zstd"):
        pytest.skip("the zstd program is not installed")
    layer = archive.layer_from_files({"usr/local/bin/hello": b"#!/bin/sh\necho hello\n"}, tmp_path / "layer",
                                     mode=0o755, compression=compression)
    assert layer.path.read_bytes()[:len(magic)] == magic
    tar = uncompressed(layer.path)
    assert layer.diff_id == "sha256:" + hashlib.sha256(tar).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(tar)) as opened:
        member = opened.getmember("usr/local/bin/hello")
        assert member.mode == 0o755 and opened.extractfile(member).read() == b"#!/bin/sh\necho hello\n"
    assert [p.name for p in tmp_path.iterdir()] == ["layer"]  # no .part left


def test_an_unknown_compression_is_refused_and_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="unknown layer compression 'xz': gzip or zstd"):
        archive.layer_from_files({"a": b"a"}, tmp_path / "layer", compression="xz")
    assert list(tmp_path.iterdir()) == []
