"""The runtime image store: importing builds, what the machines need, download tokens, the command, lab builds."""
import gzip
import hashlib
import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest
from django.core import signing
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError

from clusters import image_contents, images
from clusters.models import Cluster, ClusterMember, RuntimeImage
from lab import cli as lab_cli
from lab import images as lab_images
from tests.factories import AcceleratorFactory, MachineFactory

MIB = 1024 * 1024
X86 = lab_images.BUILDS[0]
ARM = lab_images.BUILDS[1]


@pytest.fixture
def store(settings, tmp_path):
    """The server's data directory, empty, for this test alone."""
    settings.DATA_DIR = tmp_path / "data"
    settings.DATA_DIR.mkdir()
    return settings.DATA_DIR / "runtime-images"


@pytest.fixture
def image_file(tmp_path):
    """A loadable image archive with the lab's labels, of two chunks and a bit (a 9 MiB payload)."""
    path = tmp_path / "in" / "nvidia-x86_64-runtime-2.1.0.img"
    path.parent.mkdir()
    return lab_images.synthetic_write(path, X86, 9 * MIB + 123)


def make_image(directory: Path, build=X86, payload_bytes=MIB, version="2.1.0", certified=True) -> Path:
    """An image of any version, labelled as the lab labels its builds."""
    path = directory / f"{build.accelerator_vendor}-{build.arch}-{version}-{certified}.img"
    return lab_images.synthetic_write(path, build, payload_bytes, version=version, certified=str(certified).lower())


def docker_archive(path: Path, *, labels: dict | None = None, manifest=None, config=None, layers=True) -> Path:
    """An image archive as `docker save` lays one out, with any part of it replaced."""
    layer = b"layer bytes"
    config = config if config is not None else json.dumps({"architecture": "amd64", "os": "linux",
                                                          "config": {"Labels": labels or {}}}).encode()
    manifest = manifest if manifest is not None else json.dumps(
        [{"Config": "c0ffee.json", "RepoTags": ["x:1"], "Layers": ["aa/layer.tar"]}]).encode()
    members = [("aa/layer.tar", layer)] if layers else []
    return make_tar(path, [*members, ("c0ffee.json", config), ("manifest.json", manifest)])


LABELS = {"org.fadenstack.runtime.name": "NVIDIA x86_64 Runtime", "org.fadenstack.runtime.version": "2.1.0",
          "org.fadenstack.runtime.arch": "x86_64", "org.fadenstack.runtime.accelerator-vendor": "nvidia",
          "org.fadenstack.runtime.certified": "true"}


def make_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def chunk_hashes(data: bytes, size: int = 8 * MIB) -> list[str]:
    return [hashlib.sha256(data[i:i + size]).hexdigest() for i in range(0, len(data), size)]


# -- importing -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_imported_image_records_the_digest_size_and_chunk_hashes_hashlib_computes(store, image_file):
    data = image_file.read_bytes()

    image = images.runtime_image_import(path=image_file)

    assert image.digest == hashlib.sha256(data).hexdigest()
    assert image.size_bytes == len(data)
    assert image.chunk_size == 8 * MIB
    assert image.chunk_hashes == chunk_hashes(data)
    assert len(image.chunk_hashes) == 2
    assert (image.name, image.version, image.arch, image.accelerator_vendor, image.certified) == (
        "NVIDIA x86_64 Runtime", lab_images.VERSION, "x86_64", "nvidia", True)


@pytest.mark.django_db
def test_the_stored_file_is_named_by_its_digest_and_holds_the_same_bytes(store, image_file):
    image = images.runtime_image_import(path=image_file)

    assert Path(image.path) == store / f"{image.digest}.img"
    assert Path(image.path).read_bytes() == image_file.read_bytes()
    assert [p.name for p in store.iterdir()] == [f"{image.digest}.img"]  # no temporary left behind
    assert images.runtime_image_held(image)


@pytest.mark.django_db
def test_an_image_on_another_filesystem_is_copied_rather_than_linked(store, image_file, monkeypatch):
    def cross_device(*args):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(images.os, "link", cross_device)

    image = images.runtime_image_import(path=image_file)

    assert os.stat(image.path).st_ino != image_file.stat().st_ino
    assert Path(image.path).read_bytes() == image_file.read_bytes()
    assert image.chunk_hashes == chunk_hashes(image_file.read_bytes())


@pytest.mark.django_db
def test_importing_the_same_build_twice_keeps_one_row_and_one_file(store, image_file):
    first = images.runtime_image_import(path=image_file)
    second = images.runtime_image_import(path=image_file)

    assert second.pk == first.pk
    assert RuntimeImage.objects.count() == 1
    assert len(list(store.iterdir())) == 1


@pytest.mark.django_db
def test_importing_a_build_again_brings_back_a_lost_file(store, image_file):
    image = images.runtime_image_import(path=image_file)
    Path(image.path).unlink()
    assert not images.runtime_image_held(image)

    again = images.runtime_image_import(path=image_file)

    assert again.pk == image.pk and images.runtime_image_held(again)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: p.write_bytes(os.urandom(50_000)), "is not a tar archive"),
        (lambda p: make_tar(p, []), "is an empty tar archive"),
        (lambda p: p.write_bytes(b"\x1f\x8b" + os.urandom(100)), "it is a compressed file"),
        (lambda p: make_tar(p, [("payload.bin", b"x" * 100)]), "it has no image manifest (manifest.json)"),
        (lambda p: docker_archive(p, manifest=b"not json"), "its manifest.json is not JSON"),
        (lambda p: docker_archive(p, manifest=b"[1, 2]"), "it holds 2 images; a runtime image file holds exactly one"),
        (lambda p: docker_archive(p, labels=LABELS, layers=False), "it lacks the layer aa/layer.tar its manifest.json names"),
        (lambda p: docker_archive(p, config=b"{"), "its c0ffee.json is not JSON"),
        (lambda p: docker_archive(p, labels={k: v for k, v in LABELS.items() if "name" in k or "version" in k}),
         "its labels lack org.fadenstack.runtime.arch, org.fadenstack.runtime.accelerator-vendor, "
         "org.fadenstack.runtime.certified"),
        (lambda p: docker_archive(p, labels={**LABELS, "org.fadenstack.runtime.version": "two",
                                             "org.fadenstack.runtime.certified": "yes"}),
         "a bad version 'two' (numbers with dots, like 2.1.0); a bad certified 'yes' (true or false)"),
    ],
    ids=["not-a-tar", "empty-tar", "compressed", "no-manifest", "not-json", "two-images", "missing-layer",
         "config-not-json", "missing-labels", "bad-values"],
)
def test_a_file_that_is_not_a_runtime_image_is_refused_in_plain_words_and_nothing_is_stored(store, tmp_path, make, words):
    path = tmp_path / "suspect.img"
    make(path)

    with pytest.raises(ValidationError) as refused:
        images.runtime_image_import(path=path)

    message = " ".join(refused.value.messages)
    assert message.startswith("suspect.img is not a runtime image: ")
    assert words in message
    assert not RuntimeImage.objects.exists()
    assert not store.exists() or not any(store.iterdir())


@pytest.mark.django_db
def test_a_missing_file_is_refused_by_name(store, tmp_path):
    with pytest.raises(ValidationError, match="No such file"):
        images.runtime_image_import(path=tmp_path / "nowhere.img")


# -- what the machines need -----------------------------------------------------------------


def gpu_machine(arch="x86_64", vendor="nvidia", **fields):
    machine = MachineFactory(arch=arch, **fields)
    AcceleratorFactory(machine=machine, vendor=vendor)
    return machine


@pytest.mark.django_db
def test_machines_of_two_platforms_with_one_build_held_leave_one_platform_missing(store, tmp_path):
    x86 = gpu_machine("x86_64")
    gpu_machine("aarch64")
    MachineFactory(arch="x86_64", name="cpu-only")  # no accelerators: runs no runtime
    held = images.runtime_image_import(path=make_image(tmp_path, X86))

    needs = images.runtime_images_needed()

    assert [(n.scope, n.platform, n.held) for n in needs] == [
        ("enrolled machines", "nvidia/aarch64", False),
        ("enrolled machines", "nvidia/x86_64", True),
    ]
    missing, found = needs
    assert missing.image is None and missing.major == "2"
    assert found.image == held and found.machine_names == (x86.name,)


@pytest.mark.django_db
def test_a_build_whose_file_is_gone_is_not_held(store, tmp_path):
    gpu_machine("x86_64")
    image = images.runtime_image_import(path=make_image(tmp_path, X86))
    Path(image.path).unlink()

    [need] = images.runtime_images_needed()

    assert need.image == image and not need.held


@pytest.mark.django_db
def test_the_newest_certified_build_of_major_2_is_the_one_needed(store, tmp_path):
    gpu_machine("x86_64")
    for version, certified in [("2.9.0", True), ("2.10.0", True), ("2.11.0", False), ("3.0.0", True)]:
        images.runtime_image_import(path=make_image(tmp_path, X86, version=version, certified=certified))

    [need] = images.runtime_images_needed()

    assert need.image.version == "2.10.0"


@pytest.mark.django_db
def test_machines_waiting_for_their_host_key_are_not_counted(store):
    gpu_machine("aarch64", awaiting_host_key=True)

    assert images.runtime_images_needed() == []


@pytest.mark.django_db
def test_each_cluster_needs_the_build_its_members_were_given(store, tmp_path):
    old = images.runtime_image_import(path=make_image(tmp_path, X86, version="2.1.0"))
    images.runtime_image_import(path=make_image(tmp_path, X86, version="2.2.0"))
    first, second = gpu_machine("x86_64"), gpu_machine("x86_64")
    cluster = Cluster.objects.create(name="alpha")
    ClusterMember.objects.create(cluster=cluster, machine=first, role="head", runtime_image=old)
    ClusterMember.objects.create(cluster=cluster, machine=second, role="worker")

    needs = {(n.scope, n.image.version, n.machine_names) for n in images.runtime_images_needed()}

    assert needs == {
        ("enrolled machines", "2.2.0", tuple(sorted([first.name, second.name]))),
        ("cluster alpha", "2.1.0", (first.name,)),
        ("cluster alpha", "2.2.0", (second.name,)),
    }


@pytest.mark.django_db
def test_the_needs_cost_a_few_queries_whatever_the_number_of_machines(store, tmp_path, django_assert_max_num_queries):
    for _ in range(30):
        gpu_machine("x86_64")
    images.runtime_image_import(path=make_image(tmp_path, X86))

    with django_assert_max_num_queries(5):
        images.runtime_images_needed()


# -- download tokens -----------------------------------------------------------------------


DIGEST = "ab" * 32
GRANT = images.ImageGrant(digest=DIGEST, cluster_id=7, machine_id=3)


def test_a_download_token_names_its_image_cluster_and_machine():
    token = images.image_download_token(grant=GRANT, lifetime=600)

    assert images.image_download_token_check(token) == GRANT


def test_a_tampered_or_foreign_token_is_refused():
    token = images.image_download_token(grant=GRANT, lifetime=600)

    assert images.image_download_token_check(token[:-2] + "xx") is None
    assert images.image_download_token_check("") is None
    forged = {"digest": DIGEST, "cluster": 7, "machine": 3, "expires": int(time.time()) + 600}
    assert images.image_download_token_check(signing.dumps(forged, salt="other")) is None


def test_a_token_is_refused_once_its_lifetime_has_passed(monkeypatch):
    token = images.image_download_token(grant=GRANT, lifetime=600)
    now = time.time()

    monkeypatch.setattr(images.time, "time", lambda: now + 599)
    assert images.image_download_token_check(token) == GRANT
    monkeypatch.setattr(images.time, "time", lambda: now + 601)
    assert images.image_download_token_check(token) is None


def test_a_token_made_before_tokens_named_their_machine_is_refused():
    old = signing.dumps({"digest": DIGEST, "cluster": 7}, salt=images.TOKEN_SALT)

    assert images.image_download_token_check(old) is None


# -- the command ---------------------------------------------------------------------------


def run(*args) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("runtime-images", *args, stdout=out)
    except SystemExit as exit:
        return exit.code, out.getvalue()
    return 0, out.getvalue()


@pytest.mark.django_db
def test_check_exits_1_naming_the_missing_platform_and_what_to_do(store, tmp_path):
    gpu_machine("x86_64")
    gpu_machine("aarch64")
    images.runtime_image_import(path=make_image(tmp_path, X86))

    status, output = run("--check")

    assert status == 1
    lines = output.strip().splitlines()
    assert any("nvidia/aarch64" in line and "MISSING" in line for line in lines)
    assert any("nvidia/x86_64" in line and "held" in line for line in lines)
    assert "nvidia/aarch64 2.x" in lines[-1] and "faden runtime-images import FILE" in lines[-1]


@pytest.mark.django_db
def test_check_exits_0_when_every_build_is_held(store, tmp_path):
    gpu_machine("x86_64")
    images.runtime_image_import(path=make_image(tmp_path, X86))

    status, output = run("--check")

    assert status == 0
    assert output.strip().splitlines()[-1] == "The server holds every build the machines need."


@pytest.mark.django_db
def test_import_prints_each_build_and_the_list_shows_it(store, tmp_path):
    files = [make_image(tmp_path, X86), make_image(tmp_path, ARM)]

    status, output = run("import", *map(str, files))

    assert status == 0
    x86 = RuntimeImage.objects.get(arch="x86_64")
    assert f"Imported: NVIDIA x86_64 Runtime 2.1.0  nvidia/x86_64  {x86.digest[:12]}  " in output
    assert "Imported: NVIDIA aarch64 Runtime 2.1.0  nvidia/aarch64" in output
    assert "Already held: NVIDIA x86_64 Runtime" in run("import", str(files[0]))[1]
    listing = run()[1]
    assert "NVIDIA aarch64 Runtime" in listing and x86.digest[:12] in listing and "held" in listing


@pytest.mark.django_db
def test_import_of_a_missing_file_or_a_bad_archive_fails_with_status_2_in_one_line(store, tmp_path):
    bad = tmp_path / "bad.img"
    bad.write_bytes(b"hello")

    with pytest.raises(CommandError) as missing:
        call_command("runtime-images", "import", str(tmp_path / "nowhere.img"))
    with pytest.raises(CommandError) as refused:
        call_command("runtime-images", "import", str(bad))

    assert missing.value.returncode == 2 and "No such file" in str(missing.value)
    assert refused.value.returncode == 2
    assert str(refused.value) == "bad.img is not a runtime image: it is not a tar archive."
    assert not RuntimeImage.objects.exists()


# -- lab builds ----------------------------------------------------------------------------


def test_an_archive_docker_save_lays_out_imports_with_its_labels(store, tmp_path):
    manifest = images.runtime_image_manifest_read(path=docker_archive(tmp_path / "saved.img", labels=LABELS))

    assert manifest == {"name": "NVIDIA x86_64 Runtime", "version": "2.1.0", "arch": "x86_64",
                        "accelerator_vendor": "nvidia", "certified": True}


def test_the_lab_writes_one_nvidia_image_per_arch_as_a_loadable_archive_with_its_labels(tmp_path):
    made = lab_images.images_make(tmp_path, synthetic_mib=1)

    assert [(p.name, written) for p, written in made] == [
        (f"nvidia-x86_64-runtime-{lab_images.VERSION}.img", True),
        (f"nvidia-aarch64-runtime-{lab_images.VERSION}.img", True),
    ]
    for path, _ in made:
        with tarfile.open(path) as archive:
            names = archive.getnames()
            [entry] = json.load(archive.extractfile("manifest.json"))
            config = json.load(archive.extractfile(entry["Config"]))
            layer = archive.extractfile(entry["Layers"][0]).read()
        assert names[:2] == ["manifest.json", entry["Config"]]  # the labels come first
        assert entry["RepoTags"] == [f"localhost/fadenstack-runtime:{lab_images.VERSION}-nvidia-{path.name.split('-')[1]}"]
        assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest()]
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer))) as payload:
            sizes = {m.name: m.size for m in payload.getmembers()}
        assert sizes == {"payload.bin": MIB, **{name: 0 for name in lab_images.SYNTHETIC_STAND_INS}}
        assert image_contents.runtime_image_contents_problems(path=path) == []  # the console imports it
    manifests = [images.runtime_image_manifest_read(path=p) for p, _ in made]
    assert [(m["name"], m["arch"], m["certified"]) for m in manifests] == [
        ("NVIDIA x86_64 Runtime", "x86_64", True), ("NVIDIA aarch64 Runtime", "aarch64", True)]
    assert not any("amd" in p.name for p, _ in made)


def test_the_lab_keeps_images_already_there_from_the_same_layers(tmp_path):
    first = lab_images.images_make(tmp_path, synthetic_mib=1)
    inodes = [p.stat().st_ino for p, _ in first]

    again = lab_images.images_make(tmp_path, synthetic_mib=1)
    assert [written for _, written in again] == [False, False]
    assert [p.stat().st_ino for p, _ in again] == inodes

    bigger = lab_images.images_make(tmp_path, synthetic_mib=2)
    assert [written for _, written in bigger] == [True, True]
    assert not list(tmp_path.glob("*.part"))


def test_faden_lab_images_prints_the_paths(tmp_path, capsys):
    assert lab_cli.main(["images", "--synthetic-mib", "1", "--out", str(tmp_path)]) == 0

    assert capsys.readouterr().out.split() == [str(tmp_path / b.file_name) for b in lab_images.BUILDS]
    assert lab_cli.main(["images", "--synthetic-mib", "0", "--out", str(tmp_path)]) == 2


@pytest.mark.django_db
def test_a_lab_image_imports_on_the_server(store, tmp_path):
    [(path, _), _] = lab_images.images_make(tmp_path, synthetic_mib=1)

    image = images.runtime_image_import(path=path)

    assert (image.name, image.platform, image.size_bytes) == ("NVIDIA x86_64 Runtime", "nvidia/x86_64", path.stat().st_size)


# -- what a build must hold ---------------------------------------------------------------------------


def layer_tar(members: list[tarfile.TarInfo | tuple[str, bytes]], compress=None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                archive.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                archive.addfile(info, io.BytesIO(member[1]))
    data = buffer.getvalue()
    return compress(data) if compress else data


def link(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


EVERYTHING = [link("bin", "usr/bin"), ("usr/bin/python3.11", b""), link("usr/bin/python3", "python3.11"),
              ("usr/local/bin/ray", b""), ("opt/ray/ray/dashboard/__init__.py", b""), ("opt/ray/aiohttp/__init__.py", b""),
              ("usr/bin/ssh", b""), ("usr/bin/orterun", b""), link("etc/alternatives/mpirun", "/usr/bin/orterun"),
              link("usr/bin/mpirun", "/etc/alternatives/mpirun"), ("usr/local/bin/all_reduce_perf", b""),
              ("usr/local/bin/vllm", b"")]


def image_with_layers(path: Path, layers: list[bytes], *, labels: dict | None = None, env_path: str | None = None) -> Path:
    names = [f"l{index}/layer.tar" for index in range(len(layers))]
    config = {"architecture": "amd64", "os": "linux", "config": {"Labels": {**LABELS, **(labels or {})}}}
    if env_path is not None:
        config["config"]["Env"] = [f"PATH={env_path}"]
    manifest = [{"Config": "c0ffee.json", "RepoTags": ["x:1"], "Layers": names}]
    return make_tar(path, [("manifest.json", json.dumps(manifest).encode()), ("c0ffee.json", json.dumps(config).encode()),
                           *zip(names, layers)])


@pytest.mark.django_db
def test_an_image_that_holds_every_program_and_package_is_imported_its_links_followed(store, tmp_path):
    path = image_with_layers(tmp_path / "whole.img", [layer_tar(EVERYTHING[:6], gzip.compress), layer_tar(EVERYTHING[6:])])
    assert images.runtime_image_import(path=path).name == "NVIDIA x86_64 Runtime"


@pytest.mark.django_db
def test_an_image_without_mpirun_and_vllm_is_refused_naming_each_and_the_feature_that_needs_it(store, tmp_path):
    lacking = [m for m in EVERYTHING if (m.name if isinstance(m, tarfile.TarInfo) else m[0]) not in
               ("usr/bin/mpirun", "usr/local/bin/vllm")]
    path = image_with_layers(tmp_path / "lacking.img", [layer_tar(lacking)])
    with pytest.raises(ValidationError) as refused:
        images.runtime_image_import(path=path)
    assert refused.value.messages == [
        "lacking.img is not a runtime image every feature works with: it lacks mpirun on its PATH: the NCCL test needs "
        "Open MPI's mpirun; it lacks vllm on its PATH: serving models needs vLLM. docs/runtime-images.md lists what a "
        "build must hold."]
    assert not RuntimeImage.objects.exists() and not any(store.iterdir())  # nothing stored


def test_a_file_a_later_layer_takes_away_and_ray_without_its_dashboard_are_missing(store, tmp_path):
    without_dashboard = [m for m in EVERYTHING if not (isinstance(m, tuple) and "dashboard" in m[0])]
    whiteout = layer_tar([("usr/bin/.wh.mpirun", b"")])
    path = image_with_layers(tmp_path / "later.img", [layer_tar(without_dashboard), whiteout])
    problems = image_contents.runtime_image_contents_problems(path=path)
    assert problems == ["lacks ray/dashboard: the tunnel to Ray's dashboard and job API needs Ray's dashboard packages "
                        "(ray[default])",
                        "lacks mpirun on its PATH: the NCCL test needs Open MPI's mpirun"]


def test_a_label_that_names_rays_path_is_where_ray_must_be(store, tmp_path):
    path = image_with_layers(tmp_path / "labelled.img", [layer_tar(EVERYTHING)],
                             labels={"org.fadenstack.runtime.ray": "/opt/ray/bin/ray"})
    assert image_contents.runtime_image_contents_problems(path=path) == [
        "lacks /opt/ray/bin/ray (its label org.fadenstack.runtime.ray): starting the cluster needs Ray"]


def test_the_image_s_own_path_is_where_programs_are_looked_for(store, tmp_path):
    path = image_with_layers(tmp_path / "narrow.img", [layer_tar(EVERYTHING)], env_path="/usr/local/bin")
    problems = image_contents.runtime_image_contents_problems(path=path)
    assert [p.split(":")[0] for p in problems] == ["lacks python3 on its PATH", "lacks mpirun on its PATH"]


def test_a_layer_that_is_not_a_tar_is_said_so(store, tmp_path):
    path = image_with_layers(tmp_path / "odd.img", [b"not a tar at all" * 100])
    [problem] = image_contents.runtime_image_contents_problems(path=path)
    assert problem.startswith("its layer l0/layer.tar is not a tar archive this server can read")


@pytest.mark.django_db
def test_faden_runtime_images_import_refuses_a_build_without_all_reduce_perf_and_says_which_feature_needs_it(store, tmp_path):
    lacking = [m for m in EVERYTHING if not (isinstance(m, tuple) and m[0] == "usr/local/bin/all_reduce_perf")]
    path = image_with_layers(tmp_path / "no-nccl-tests.img", [layer_tar(lacking)])
    with pytest.raises(CommandError) as refused:
        call_command("runtime-images", "import", str(path))
    assert refused.value.returncode == 2
    assert "it lacks all_reduce_perf on its PATH: the NCCL test needs nccl-tests' all_reduce_perf." in str(refused.value)
    assert not RuntimeImage.objects.exists()
