"""Container image files in the docker-archive format, written without an engine.

What ``docker save`` writes and ``docker load`` / ``podman load`` read: an
uncompressed tar holding ``manifest.json`` (which config and which layers make
the image, and its tag), the image's config (architecture, environment,
command, labels, and the sha256 of each layer's uncompressed tar) and the
layers. Here the manifest and the config come first, so a reader finds the
labels without reading past them, and each layer is a compressed tar (the
engines detect a layer's compression), so the file the machines move is small
while every member of the outer tar stays seekable. Layers are gzip by default,
which every engine reads; ``zstd`` (the `zstd` program) for the big layers of an
image only Podman loads: Podman reads a zstd layer in half the time of a gzip one
(`podman load` of the lab's Ray image: 4.1 s against 9.9 s on this host), and it is smaller too.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

BLOCK = 1024 * 1024
# The engines' names for the architectures the console knows by `uname -m`.
ENGINE_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


@dataclass(frozen=True)
class Layer:
    """A compressed layer tar on disk and the sha256 of its uncompressed bytes (the image's diff id)."""

    path: Path
    diff_id: str


class _Hashing(io.RawIOBase):
    """A writable stream that hashes what passes through it on the way to ``target``."""

    def __init__(self, target):
        self.target, self.sha = target, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sha.update(data)
        return self.target.write(data)


def _compressed(path: Path, write_tar, compression: str = "gzip") -> Layer:
    """Run ``write_tar(stream)`` into ``path`` compressed (gzip or zstd); the layer with the uncompressed
    tar's sha256."""
    if compression not in ("gzip", "zstd"):
        raise ValueError(f"unknown layer compression {compression!r}: gzip or zstd")
    partial = path.with_name(path.name + ".part")
    try:
        if compression == "gzip":
            with open(partial, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=3, mtime=0) as zipped:
                hashing = _Hashing(zipped)
                write_tar(hashing)
        else:
            hashing = _zstd_into(partial, write_tar)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return Layer(path=path, diff_id="sha256:" + hashing.sha.hexdigest())


def _zstd_into(partial: Path, write_tar) -> _Hashing:
    """``write_tar`` through the `zstd` program (level 3, every core) into ``partial``."""
    if not shutil.which("zstd"):
        raise RuntimeError("a zstd layer needs the zstd program (apt-get install zstd)")
    with open(partial, "wb") as raw:
        program = subprocess.Popen(["zstd", "-q", "-3", "-T0", "-c"], stdin=subprocess.PIPE, stdout=raw,
                                   stderr=subprocess.PIPE)
        hashing = _Hashing(program.stdin)
        try:
            write_tar(hashing)
        except BaseException:
            program.kill()
            program.wait()
            raise
        said = program.communicate()[1]  # stdin closed: zstd finishes the frame and exits
    if program.returncode != 0:
        raise RuntimeError(f"zstd exited {program.returncode}: {said.decode(errors='replace').strip()[-400:]}")
    return hashing


def layer_from_tar(source: Path, out: Path, *, compression: str = "gzip") -> Layer:
    """A layer from a root file system tar as it is (``mmdebstrap`` writes one with devices and owners)."""
    def copy(stream) -> None:
        with open(source, "rb") as tar:
            shutil.copyfileobj(tar, stream, BLOCK)
    return _compressed(out, copy, compression)


def layer_from_dir(source: Path, out: Path, *, under: str = "", compression: str = "gzip") -> Layer:
    """A layer from the files under ``source``, placed at ``under`` in the image, owned by root."""
    def root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    def pack(stream) -> None:
        with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for entry in sorted(Path(source).iterdir()):
                tar.add(entry, arcname=os.path.join(under.strip("/"), entry.name), filter=root_owned)
    return _compressed(out, pack, compression)


def layer_from_files(files: dict[str, bytes], out: Path, *, mode: int = 0o644, compression: str = "gzip") -> Layer:
    """A layer holding ``files`` (path in the image -> bytes); parent directories are made as needed."""
    def pack(stream) -> None:
        with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for name, data in sorted(files.items()):
                info = tarfile.TarInfo(name.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), mode, 0
                tar.addfile(info, io.BytesIO(data))
    return _compressed(out, pack, compression)


def image_config(*, arch: str, labels: dict[str, str], env: dict[str, str] | None = None,
                 cmd: list[str] | None = None, layers: list[Layer]) -> dict:
    """The image's config as the engines read it."""
    return {
        "architecture": ENGINE_ARCH.get(arch, arch),
        "os": "linux",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {
            "Env": [f"{name}={value}" for name, value in (env or {}).items()],
            "Cmd": cmd or ["/bin/sh"],
            "Labels": dict(labels),
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
    }


def archive_write(path: Path, *, tag: str, config: dict, layers: list[Layer]) -> None:
    """Write the docker-archive file: to a ``.part`` file renamed at the end, so a half-written one never shows."""
    config_bytes = json.dumps(config, indent=2, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    names = [f"{layer.diff_id.split(':', 1)[1]}/layer.tar" for layer in layers]
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": names}], indent=2).encode()
    partial = path.with_name(path.name + ".part")
    try:
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as archive:
            for name, data in (("manifest.json", manifest), (config_name, config_bytes)):
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                archive.addfile(info, io.BytesIO(data))
            for name, layer in zip(names, layers):
                archive.add(layer.path, arcname=name, recursive=False)
        # A new file (a new inode) replaces the old: a console that hard-linked the old one keeps it intact.
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
