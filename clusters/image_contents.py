"""What a runtime image must hold for every feature to work with it, checked from its file list.

A build is imported only when its layers hold every program and package a feature runs inside the
runtime container (``NEEDS``, docs/runtime-images.md): the file list of each layer is read in order
(whiteouts take files away, as the engines apply them), and each program is looked for where the
agent looks: the path a label names (``org.fadenstack.runtime.ray`` / ``.python``), else the image's
``PATH``. Symbolic links are followed inside the image (``/bin`` is ``usr/bin`` on merged-/usr
systems, ``mpirun`` is a link to ``orterun``). The check reads names, not programs: a file at the
right place passes.

Layers may be plain, gzip, bzip2, xz or zstd tars (the lab's are zstd; Python reads zstd only
through the ``zstd`` program, which is asked for in words when a layer needs it).
"""
from __future__ import annotations

import json
import posixpath
import shutil
import subprocess
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path

LABEL = "org.fadenstack.runtime."
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # the engines' default
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
WHITEOUT, OPAQUE = ".wh.", ".wh..wh..opq"
LINK_HOPS = 40  # as the kernel's limit on symbolic links followed in one path


class ImageUnreadable(Exception):
    """A layer's file list cannot be read: the message says which and why."""


@dataclass(frozen=True)
class Need:
    """One thing a feature runs inside the runtime container: a ``program`` looked for on the image's
    PATH (or at the path its ``label`` names), or a Python ``package`` (a file that ends so)."""

    what: str
    feature: str
    program: str = ""
    label: str = ""
    package: str = ""


NEEDS = (
    Need("Python", "the agent's commands inside the container and the NCCL test's launcher", program="python3",
         label="python"),
    Need("Ray", "starting the cluster", program="ray", label="ray"),
    Need("Ray's dashboard packages (ray[default])", "the tunnel to Ray's dashboard and job API",
         package="ray/dashboard/__init__.py"),
    Need("aiohttp, one of Ray's dashboard packages (ray[default])", "the tunnel to Ray's dashboard and job API",
         package="aiohttp/__init__.py"),
    Need("Open MPI's mpirun", "the NCCL test", program="mpirun"),
    Need("nccl-tests' all_reduce_perf", "the NCCL test", program="all_reduce_perf"),
    Need("vLLM", "serving models", program="vllm"),
)


class FileList:
    """The image's files as its layers leave them: each path, and where each symbolic link points."""

    def __init__(self):
        self.paths: set[str] = set()
        self.links: dict[str, str] = {}

    def apply(self, names: list[tuple[str, str | None]]) -> None:
        """One layer, applied over the ones before: ``(path, link target or None)`` per member."""
        for name, target in names:
            directory, base = posixpath.split(name)
            if base == OPAQUE:
                self._remove_under(directory, keep_self=True)
            elif base.startswith(WHITEOUT):
                self._remove_under(posixpath.join(directory, base[len(WHITEOUT):]))
            else:
                self.paths.add(name)
                if target is not None:
                    self.links[name] = target
                else:
                    self.links.pop(name, None)

    def _remove_under(self, path: str, keep_self: bool = False) -> None:
        prefix = path + "/" if path else ""
        gone = {p for p in self.paths if p.startswith(prefix) or (p == path and not keep_self)}
        self.paths -= gone
        for name in gone:
            self.links.pop(name, None)

    def resolve(self, path: str) -> str | None:
        """``path`` (absolute) with every symbolic link in it followed; None past LINK_HOPS links."""
        parts, done, hops = [p for p in path.split("/") if p], [], 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                done = done[:-1]
                continue
            if part == ".":
                continue
            current = "/".join(done + [part])
            target = self.links.get(current)
            if target is None:
                done.append(part)
                continue
            hops += 1
            if hops > LINK_HOPS:
                return None
            base = [] if target.startswith("/") else done
            parts = [p for p in target.split("/") if p] + parts
            done = list(base)
        return "/".join(done)

    def exists(self, path: str) -> bool:
        resolved = self.resolve(path)
        return resolved is not None and resolved in self.paths

    def has_package_file(self, ending: str) -> bool:
        return any(path == ending or path.endswith("/" + ending) for path in self.paths)


def _member_names(archive: tarfile.TarFile) -> list[tuple[str, str | None]]:
    names = []
    for member in archive:
        name = posixpath.normpath(member.name.lstrip("/").removeprefix("./"))
        if name in (".", ""):
            continue
        target = member.linkname if member.issym() else None
        if member.islnk():  # a hard link is the file it names
            target = "/" + posixpath.normpath(member.linkname.lstrip("/").removeprefix("./"))
        names.append((name, target))
    return names


def _zstd_names(layer, layer_name: str) -> list[tuple[str, str | None]]:
    zstd = shutil.which("zstd")
    if zstd is None:
        raise ImageUnreadable(f"its layer {layer_name} is zstd-compressed, and this server has no zstd program to "
                              "read its file list (apt-get install zstd)")
    process = subprocess.Popen([zstd, "-dcq"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def feed():
        try:
            while block := layer.read(1024 * 1024):
                process.stdin.write(block)
        except (BrokenPipeError, OSError):
            pass
        finally:
            try:
                process.stdin.close()
            except OSError:
                pass

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        with tarfile.open(fileobj=process.stdout, mode="r|", bufsize=1024 * 1024) as archive:  # skips files in big reads
            return _member_names(archive)
    finally:
        process.stdout.close()
        process.kill()
        process.wait()
        feeder.join()


def _layer_names(archive: tarfile.TarFile, member: tarfile.TarInfo) -> list[tuple[str, str | None]]:
    layer = archive.extractfile(member)
    magic = layer.read(4)
    layer.seek(0)
    if magic == ZSTD_MAGIC:
        return _zstd_names(layer, member.name)
    with tarfile.open(fileobj=layer, mode="r:*") as inner:
        return _member_names(inner)


def image_files(path: Path) -> tuple[FileList, dict, str]:
    """The image's file list, labels and PATH, from a docker-archive whose manifest has been checked
    (``images.runtime_image_manifest_read``). ImageUnreadable when a layer cannot be read."""
    files = FileList()
    with tarfile.open(path, mode="r:") as archive:
        members = {m.name.removeprefix("./"): m for m in archive.getmembers()}
        entry = json.loads(archive.extractfile(members["manifest.json"]).read())[0]
        config = json.loads(archive.extractfile(members[entry["Config"].removeprefix("./")]).read())
        for name in entry["Layers"]:
            try:
                files.apply(_layer_names(archive, members[name.removeprefix("./")]))
            except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
                raise ImageUnreadable(f"its layer {name} is not a tar archive this server can read ({exc})") from exc
    settings = config.get("config") or {}
    labels = settings.get("Labels") or {}
    env_path = next((item.partition("=")[2] for item in settings.get("Env") or [] if isinstance(item, str)
                     and item.startswith("PATH=")), DEFAULT_PATH)
    return files, labels if isinstance(labels, dict) else {}, env_path


def missing_sentences(files: FileList, labels: dict, env_path: str) -> list[str]:
    """One sentence per need the image does not meet: ``lacks mpirun on its PATH: the NCCL test needs
    Open MPI's mpirun``."""
    said = []
    for need in NEEDS:
        if need.package:
            if not files.has_package_file(need.package):
                said.append(f"lacks {need.package.rsplit('/', 1)[0]}: {need.feature} needs {need.what}")
            continue
        named = labels.get(LABEL + need.label) if need.label else None
        if isinstance(named, str) and named.startswith("/"):
            if not files.exists(named):
                said.append(f"lacks {named} (its label {LABEL + need.label}): {need.feature} needs {need.what}")
            continue
        program = named if isinstance(named, str) and named and "/" not in named else need.program
        if not any(files.exists(posixpath.join(directory, program)) for directory in env_path.split(":") if directory):
            said.append(f"lacks {program} on its PATH: {need.feature} needs {need.what}")
    return said


_PASSED: set[str] = set()  # digests of builds that held everything: the same bytes are not read twice by a process


def runtime_image_contents_problems(*, path: Path, digest: str = "") -> list[str]:
    """What the image lacks for some feature, in sentences (empty when it holds everything in NEEDS).
    ``digest``, the file's sha256 when known, spares reading a build again that passed before."""
    if digest and digest in _PASSED:
        return []
    try:
        files, labels, env_path = image_files(Path(path))
    except ImageUnreadable as exc:
        return [str(exc)]
    problems = missing_sentences(files, labels, env_path)
    if digest and not problems:
        _PASSED.add(digest)
    return problems
