"""The server's model store on disk: files by their sha256, each model's tree of links, room checks.

Under ``DATA_DIR/models/``:

- ``blobs/<sha256>``: every file of every model once, after it matched its digest (two revisions
  sharing a file share it);
- ``repos/<org>--<name>/<commit>/<path>``: a model's files as its repository lays them out, hard
  links to the blobs (what the facts are read from, and what a person can point an engine at);
- ``downloads/<model id>/``: huggingface_hub's folder while a model downloads; its partial files
  are what a Try again resumes from. It goes once the model is whole.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

CHUNK_SIZE = 8 * 1024 * 1024  # machines check each chunk as it arrives (the transfer layer)


def root() -> Path:
    return Path(settings.DATA_DIR) / "models"


def blobs_dir() -> Path:
    return root() / "blobs"


def blob_path(sha256: str) -> Path:
    return blobs_dir() / sha256


def downloads_dir(model_id: int) -> Path:
    return root() / "downloads" / str(model_id)


def tree_dir(repo: str, commit: str) -> Path:
    return root() / "repos" / repo.replace("/", "--") / commit


def ensure_dirs() -> None:
    for directory in (blobs_dir(), root() / "downloads", root() / "repos"):
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)


def gb(size: int | float) -> str:
    """Bytes in decimal gigabytes, as disks are sold: 14.2 GB (MB below one)."""
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def disk_space_problem(needed: int, *, where: Path | None = None) -> str | None:
    """The sentence that refuses a download or import that would not fit; None when it fits."""
    where = where or root()
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    free = shutil.disk_usage(where).free
    if needed <= free:
        return None
    return f"Needs {gb(needed)} free in {where}; {gb(free)} are free."


@dataclass(frozen=True)
class Hashed:
    sha256: str
    size: int
    chunk_hashes: list[str]
    blob_id: str  # git's blob id of the same bytes


def hash_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> Hashed:
    """The file's sha256, its chunks' sha256 and its git blob id, in one read."""
    size = path.stat().st_size
    whole, git = hashlib.sha256(), hashlib.sha1(usedforsecurity=False)
    git.update(b"blob %d\0" % size)
    chunks: list[str] = []
    done = 0
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_SIZE):
            whole.update(chunk)
            git.update(chunk)
            chunks.append(hashlib.sha256(chunk).hexdigest())
            done += len(chunk)
            if on_bytes:
                on_bytes(done)
    return Hashed(sha256=whole.hexdigest(), size=done, chunk_hashes=chunks, blob_id=git.hexdigest())


def blob_adopt(source: Path, sha256: str, *, keep_source: bool = False) -> Path:
    """Put a checked file into the store under its digest (moved, or hard-linked/copied when the source stays)."""
    ensure_dirs()
    target = blob_path(sha256)
    if target.exists():
        if not keep_source:
            source.unlink(missing_ok=True)
        return target
    temporary = target.with_name(f".{sha256}.part")
    if keep_source:  # a link to the very file (a snapshot's entries are symlinks), or a copy on another disk
        try:
            os.link(os.path.realpath(source), temporary)
        except OSError:
            shutil.copyfile(source, temporary)
            os.chmod(temporary, 0o600)
    else:
        os.replace(source, temporary)
        os.chmod(temporary, 0o600)
    os.replace(temporary, target)
    return target


def tree_link(repo: str, commit: str, files: list[tuple[str, str]]) -> Path:
    """The model's directory: each (path, sha256) linked to its blob. Paths were checked when listed."""
    directory = tree_dir(repo, commit)
    for path, sha256 in files:
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if target.exists():
            target.unlink()
        os.link(blob_path(sha256), target)
    return directory


def path_problem(path: str) -> str | None:
    """A repository file path that would leave the model's directory, or is odd; None when safe."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\0" in path or len(path) > 1000 or any(p in ("", ".", "..") for p in parts):
        return f"The file name {path[:200]!r} is not one the store can keep."
    return None


def unused_blobs_remove(in_use: set[str]) -> int:
    """Remove the store's blobs no model uses; the bytes freed."""
    freed = 0
    if not blobs_dir().is_dir():
        return 0
    for entry in os.scandir(blobs_dir()):
        if entry.is_file() and not entry.name.startswith(".") and entry.name not in in_use:
            freed += entry.stat().st_size
            os.unlink(entry.path)
    return freed


def tree_remove(repo: str, commit: str) -> None:
    shutil.rmtree(tree_dir(repo, commit), ignore_errors=True)
    parent = tree_dir(repo, commit).parent
    if parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()


def local_files(directory: Path) -> list[tuple[str, Path]]:
    """A directory's files as (repository path, file), leaving out git's and huggingface_hub's own folders."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if d not in (".git", ".cache", ".huggingface"))
        for name in sorted(filenames):
            full = Path(dirpath) / name
            if full.is_file():
                found.append((full.relative_to(directory).as_posix(), full))
    return found


def manifest_id(files: list[tuple[str, str]]) -> str:
    """A commit-like id (40 hex) for an imported model: the sha1 of its sorted (path, sha256) pairs."""
    text = "\n".join(f"{path}\0{sha256}" for path, sha256 in sorted(files))
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
