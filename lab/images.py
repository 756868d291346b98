"""Runtime image files for the lab: real tar archives the console imports and the machines move.

Each is ``manifest.json`` first (what the console and the agent read), then
``payload.bin`` of random bytes standing in for Ray and the engine, so that
transfers, resumes and chunk checks work on bytes that do not compress or
repeat. One build per NVIDIA platform the lab's machines have, none for AMD:
the lab's AMD machine is the one with no certified runtime.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
DEFAULT_SIZE_MIB = 256
VERSION = "2.1.0"
RANDOM_BLOCK = 4 * MIB  # os.urandom in blocks this big: fast, and little memory


@dataclass(frozen=True)
class Build:
    name: str
    arch: str
    accelerator_vendor: str

    @property
    def file_name(self) -> str:
        return f"{self.accelerator_vendor}-{self.arch}-runtime-{VERSION}.img"


BUILDS = (
    Build(name="NVIDIA x86_64 Runtime", arch="x86_64", accelerator_vendor="nvidia"),
    Build(name="NVIDIA aarch64 Runtime", arch="aarch64", accelerator_vendor="nvidia"),
)


class _RandomBytes(io.RawIOBase):
    """A file-like source of random bytes for tarfile to copy from."""

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return os.urandom(size)


def manifest_bytes(build: Build) -> bytes:
    manifest = {
        "name": build.name,
        "version": VERSION,
        "arch": build.arch,
        "accelerator_vendor": build.accelerator_vendor,
        "certified": True,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return json.dumps(manifest, indent=2).encode() + b"\n"


def expected_size(build: Build, payload_bytes: int) -> int:
    """The file's size in bytes: the same layout tarfile writes (headers, 512-byte blocks, end, record)."""

    def blocks(n: int) -> int:
        return -(-n // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE

    body = (tarfile.BLOCKSIZE + blocks(len(manifest_bytes(build)))
            + tarfile.BLOCKSIZE + blocks(payload_bytes) + 2 * tarfile.BLOCKSIZE)
    return -(-body // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def image_write(path: Path, build: Build, payload_bytes: int) -> None:
    """Write one image to ``path``: to a ``.part`` file renamed at the end, so a half-written one never shows."""
    partial = path.with_name(path.name + ".part")
    now = int(time.time())
    manifest = manifest_bytes(build)
    try:
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT, copybufsize=RANDOM_BLOCK) as archive:
            info = tarfile.TarInfo("manifest.json")
            info.size, info.mtime, info.mode = len(manifest), now, 0o644
            archive.addfile(info, io.BytesIO(manifest))
            info = tarfile.TarInfo("payload.bin")
            info.size, info.mtime, info.mode = payload_bytes, now, 0o644
            archive.addfile(info, _RandomBytes())
        # A new file (a new inode) replaces the old: a console that hard-linked the old one keeps it intact.
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def images_make(out_dir: Path, size_mib: int = DEFAULT_SIZE_MIB) -> list[tuple[Path, bool]]:
    """Write the lab's runtime images into ``out_dir``: ``(path, written)``; files already there whole are kept."""
    if size_mib < 1:
        raise ValueError("the image size must be at least 1 MiB")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for build in BUILDS:
        path = out_dir / build.file_name
        if path.is_file() and path.stat().st_size == expected_size(build, size_mib * MIB):
            made.append((path, False))
            continue
        image_write(path, build, size_mib * MIB)
        made.append((path, True))
    return made
