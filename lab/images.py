"""The lab's runtime images: real container images, docker-archive files that ``docker load`` and
``podman load`` read and the console imports.

A build is three layers: a minimal Debian root file system made from Debian's packages by
``mmdebstrap`` (with Python, and Open MPI's ``mpirun`` and an SSH client for the NCCL test), Ray from
PyPI (installed for that Python by pip, for the image's platform, without running anything inside
it), and the lab's programs: its inference engine (``lab/stubs/vllm``, the stand-in for vLLM, at
``/usr/local/bin/vllm``) and its ``all_reduce_perf`` (``lab/stubs/all_reduce_perf``, the stand-in
for nccl-tests', at ``/usr/local/bin/all_reduce_perf``: the real Open MPI launches it). The two big
layers are zstd-compressed (the lab's machines load the image with Podman, which reads zstd in half
the time of gzip: lab/archive.py), the small one gzip. Each layer is
cached by its inputs under the cache directory (``FADEN_LAB_CACHE``, default
``~/.cache/fadenstack-lab``), so a second build takes seconds. What the console needs to know of a build lives in the image's labels (``LABELS``).

One build per NVIDIA platform the lab's machines have, none for AMD: the lab's AMD machine is the
one with no certified runtime. The lab's aarch64 machine is this x86 host behind a stub ``uname``,
so its build carries the same x86_64 binaries under the aarch64 label (lab/README.md).

For tests that move images but never run them (the ``process`` driver), ``synthetic`` builds are
loadable archives of the same labels whose one layer is random bytes of a chosen size, with empty
stand-ins where the console's import looks for the programs a runtime image must hold.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from . import archive
from .util import LabError

MIB = 1024 * 1024
VERSION = "2.3.0"  # 2.2: the engine (vllm) in the image; 2.3: mpirun, ssh and all_reduce_perf (the NCCL test), ray[default]
RECIPE = 1  # raise when the steps below change what a layer holds
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = ("python3", "ca-certificates", "procps", "iproute2", "openmpi-bin", "openssh-client")
PYTHON = ("3.11", "cp311")  # bookworm's python3
PIP_PLATFORM = {"x86_64": "manylinux2014_x86_64", "aarch64": "manylinux2014_aarch64"}
RAY_DIR = "/opt/fadenstack/ray"
ENGINE = Path(__file__).resolve().parent / "stubs" / "vllm"
ENGINE_IN_IMAGE = "usr/local/bin/vllm"
ALL_REDUCE = Path(__file__).resolve().parent / "stubs" / "all_reduce_perf"
ALL_REDUCE_IN_IMAGE = "usr/local/bin/all_reduce_perf"
LABEL = "org.fadenstack.runtime."
# Where a synthetic build holds empty stand-ins: the paths the console's import looks for (the programs
# on the image's PATH, Ray's dashboard packages: docs/runtime-images.md), so it imports a synthetic build
# as it does a real one. The `process` driver never runs them.
SYNTHETIC_STAND_INS = ("usr/bin/python3", "usr/local/bin/ray", RAY_DIR.lstrip("/") + "/ray/dashboard/__init__.py",
                       RAY_DIR.lstrip("/") + "/aiohttp/__init__.py", "usr/bin/ssh", "usr/bin/mpirun",
                       ALL_REDUCE_IN_IMAGE, ENGINE_IN_IMAGE)
RAY_WRAPPER = b"""#!/usr/bin/python3
# Ray's command line, for the Ray installed in %s.
import sys
from ray.scripts.scripts import main
sys.exit(main())
""" % RAY_DIR.encode()


@dataclass(frozen=True)
class Build:
    name: str
    arch: str
    accelerator_vendor: str

    @property
    def file_name(self) -> str:
        return f"{self.accelerator_vendor}-{self.arch}-runtime-{VERSION}.img"

    @property
    def tag(self) -> str:
        return f"localhost/fadenstack-runtime:{VERSION}-{self.accelerator_vendor}-{self.arch}"

    def labels(self, ray_version: str) -> dict[str, str]:
        return {f"{LABEL}name": self.name, f"{LABEL}version": VERSION, f"{LABEL}arch": self.arch,
                f"{LABEL}accelerator-vendor": self.accelerator_vendor, f"{LABEL}certified": "true",
                f"{LABEL}ray-version": ray_version}


BUILDS = (
    Build(name="NVIDIA x86_64 Runtime", arch="x86_64", accelerator_vendor="nvidia"),
    Build(name="NVIDIA aarch64 Runtime", arch="aarch64", accelerator_vendor="nvidia"),
)


def cache_dir() -> Path:
    return Path(os.environ.get("FADEN_LAB_CACHE") or Path.home() / ".cache" / "fadenstack-lab")


def ray_version() -> str:
    """The Ray the lab runs from: the images carry the same, so the lab's Ray and theirs agree."""
    return metadata.version("ray")


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps([RECIPE, *parts]).encode()).hexdigest()[:16]


def _layer_at(path: Path, make) -> archive.Layer:
    """The layer at ``path`` (its diff id beside it, in a .json), made by ``make(path)`` when it is not there."""
    meta = path.with_name(path.name + ".json")
    if path.is_file() and meta.is_file():
        return archive.Layer(path=path, diff_id=json.loads(meta.read_text())["diff_id"])
    layer = make(path)
    meta.write_text(json.dumps({"diff_id": layer.diff_id}))
    return layer


def _cached_layer(name: str, key: str, make, suffix: str = ".tar.gz") -> archive.Layer:
    """The layer ``name-key`` from the cache directory, made when it is not there."""
    directory = cache_dir() / "layers"
    directory.mkdir(parents=True, exist_ok=True)
    return _layer_at(directory / f"{name}-{key}{suffix}", make)


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise LabError(f"{what} failed ({argv[0]} exited {done.returncode}): {(done.stderr or done.stdout).strip()[-800:]}")


def debian_layer() -> archive.Layer:
    """Debian's minimal root file system with Python, from Debian's packages."""
    def make(out: Path) -> archive.Layer:
        if not shutil.which("mmdebstrap"):
            raise LabError("building the lab's runtime image needs mmdebstrap (apt-get install mmdebstrap)")
        _need_zstd()
        with tempfile.TemporaryDirectory(prefix="fadenstack-rootfs-") as work:
            rootfs = Path(work) / "rootfs.tar"
            _run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}",
                  DEBIAN_SUITE, str(rootfs)], "mmdebstrap")
            return archive.layer_from_tar(rootfs, out, compression="zstd")
    return _cached_layer("debian", _key(DEBIAN_SUITE, DEBIAN_PACKAGES), make, ".tar.zst")


def _need_zstd() -> None:
    if not shutil.which("zstd"):
        raise LabError("building the lab's runtime image needs zstd (apt-get install zstd)")


def ray_layer(arch: str, version: str) -> archive.Layer:
    """Ray from PyPI for the image's Python and platform, in RAY_DIR, with ``ray`` on the PATH."""
    def make(out: Path) -> archive.Layer:
        _need_zstd()
        with tempfile.TemporaryDirectory(prefix="fadenstack-ray-") as work:
            tree = Path(work)
            target = tree / RAY_DIR.lstrip("/")
            _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--disable-pip-version-check",
                  "--target", str(target), "--platform", PIP_PLATFORM[arch], "--python-version", PYTHON[0],
                  "--implementation", "cp", "--abi", PYTHON[1], "--only-binary=:all:", f"ray[default]=={version}"],
                 f"pip install ray[default]=={version}")  # [default]: the dashboard and job API the tunnel reaches
            shutil.rmtree(target / "bin", ignore_errors=True)  # scripts for this host's Python, not the image's
            (tree / "usr/local/bin").mkdir(parents=True)
            (tree / "usr/local/bin/ray").write_bytes(RAY_WRAPPER)
            (tree / "usr/local/bin/ray").chmod(0o755)
            site = tree / "usr/lib/python3/dist-packages"
            site.mkdir(parents=True)
            (site / "fadenstack-ray.pth").write_text(RAY_DIR + "\n")  # read even by `python3 -I`
            return archive.layer_from_dir(tree, out, compression="zstd")
    return _cached_layer(f"ray-{arch}", _key(arch, version, "default", PYTHON, PIP_PLATFORM[arch]), make, ".tar.zst")


def engine_layer() -> archive.Layer:
    """The lab's programs in /usr/local/bin: the engine (vllm: the same file the `process` driver runs on
    the lab host; only the engine stands in for vLLM, the console's path to it is a real machine's) and
    all_reduce_perf (nccl-tests' program, which the NCCL test runs under the image's mpirun)."""
    files = {ENGINE_IN_IMAGE: ENGINE.read_bytes(), ALL_REDUCE_IN_IMAGE: ALL_REDUCE.read_bytes()}
    key = _key(*(hashlib.sha256(data).hexdigest() for data in files.values()))
    return _cached_layer("engine", key, lambda path: archive.layer_from_files(files, path, mode=0o755))


def synthetic_files(payload_bytes: int) -> dict[str, bytes]:
    """One file of random bytes (bytes that neither compress nor repeat, for transfers and resumes) and
    the empty stand-ins."""
    return {"payload.bin": os.urandom(payload_bytes), **{name: b"" for name in SYNTHETIC_STAND_INS}}


def synthetic_layer(out_dir: Path, size_mib: int) -> archive.Layer:
    """The synthetic build's one layer, kept beside the images it went into."""
    return _layer_at(out_dir / f".synthetic-{size_mib}-stand-ins.tar.gz",
                     lambda path: archive.layer_from_files(synthetic_files(size_mib * MIB), path, mode=0o755))


def synthetic_write(path: Path, build: Build, payload_bytes: int, **labels: str) -> Path:
    """One synthetic image at ``path`` whose payload is ``payload_bytes`` random bytes; ``labels``
    (field=value, as ``version="3.0.0"``) replace the build's own."""
    with tempfile.TemporaryDirectory(prefix="fadenstack-image-") as work:
        layer = archive.layer_from_files(synthetic_files(payload_bytes), Path(work) / "layer.tar.gz", mode=0o755)
        _write(path, build, [layer], "none", {LABEL + name.replace("_", "-"): value for name, value in labels.items()})
    return path


def _write(path: Path, build: Build, layers: list[archive.Layer], ray: str, labels: dict | None = None) -> None:
    config = archive.image_config(arch=build.arch, labels={**build.labels(ray), **(labels or {})}, layers=layers,
                                  env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
                                  cmd=["sleep", "infinity"])
    archive.archive_write(path, tag=build.tag, config=config, layers=layers)


def images_make(out_dir: Path, synthetic_mib: int | None = None) -> list[tuple[Path, bool]]:
    """Write the lab's runtime images into ``out_dir``: ``(path, written)``. Real builds already there
    from the same layers are kept; ``synthetic_mib`` writes synthetic ones of that size instead."""
    if synthetic_mib is not None and synthetic_mib < 1:
        raise ValueError("the synthetic payload must be at least 1 MiB")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ray = ray_version()
    made = []
    for build in BUILDS:
        if synthetic_mib is None:
            layers = [debian_layer(), ray_layer(platform.machine(), ray), engine_layer()]  # this host's binaries
        else:
            layers = [synthetic_layer(out_dir, synthetic_mib)]
        path = out_dir / build.file_name
        stamp = out_dir / f".{build.file_name}.layers"
        inputs = json.dumps([layer.diff_id for layer in layers])
        if path.is_file() and stamp.is_file() and stamp.read_text() == inputs:
            made.append((path, False))
            continue
        _write(path, build, layers, ray)
        stamp.write_text(inputs)
        made.append((path, True))
    return made
