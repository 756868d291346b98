"""The runtime image store on the server: importing builds, what the machines need, download tokens.

A runtime image is a container image archive (docker-archive, as ``docker save``
and ``podman save`` write it) labelled with what the console needs to know of
the build (``LABELS``; docs/runtime-images.md). The server keeps each build as
``DATA_DIR/runtime-images/<sha256>.img`` with a ``RuntimeImage`` row holding
the sha256 of the file and of every 8 MiB chunk (machines check each chunk as
it arrives, so that a dropped transfer resumes at its last verified chunk).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.core import signing
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from clusters import image_contents, planning
from clusters.choices import ClusterState
from clusters.models import Cluster, ClusterMember, RuntimeImage
from clusters.transfer import ServerFile
from machines.agent_client import FileSpec
from machines.choices import MachineState
from machines.models import Accelerator, Machine

CHUNK_SIZE = 8 * 1024 * 1024
MANIFEST_NAME = "manifest.json"
MANIFEST_MAX_BYTES = 256 * 1024  # an image's manifest or config is a few KiB; more is not one
MANIFEST_FIELDS = ("name", "version", "arch", "accelerator_vendor", "certified")
# Where each field is read from: the image's labels (docs/runtime-images.md).
LABELS = {field: "org.fadenstack.runtime." + field.replace("_", "-") for field in MANIFEST_FIELDS}

TOKEN_SALT = "runtime-image"

# The major a cluster asks for when nothing says otherwise: the machines' row of --check uses it too.
DEFAULT_MAJOR = str(Cluster._meta.get_field("runtime_version").default)

_VERSION = re.compile(r"^\d+(\.[0-9A-Za-z]+)*$")  # 2.1.0, 2.1.0rc1
_TOKEN = re.compile(r"^[a-z0-9_]+$")  # x86_64, aarch64, nvidia, amd
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def store_dir() -> Path:
    """Where the server keeps its builds (read at call time: tests point DATA_DIR elsewhere)."""
    return Path(settings.DATA_DIR) / "runtime-images"


# -- import -------------------------------------------------------------------------------------


def runtime_image_manifest_read(*, path: Path) -> dict:
    """What the console needs to know of a runtime image file, from its labels; ValidationError in
    plain words when the file is not a loadable image archive or its labels do not say."""
    path = Path(path)
    shown = path.name

    def refuse(reason: str, code: str = "not_an_image") -> ValidationError:
        return ValidationError(f"{shown} is not a runtime image: {reason}", code=code)

    if not path.exists():
        raise ValidationError(f"No such file: {path}", code="missing")
    if not path.is_file():
        raise refuse("it is a directory or a special file, not a file.")
    with path.open("rb") as file:
        magic = file.read(6)
    if magic[:2] == b"\x1f\x8b" or magic[:3] == b"BZh" or magic == b"\xfd7zXZ\x00" or magic[:4] == b"\x28\xb5\x2f\xfd":
        raise refuse("it is a compressed file; the machines fetch an image in verified chunks, so import the "
                     "uncompressed archive (`docker save` or `podman save` writes one).", code="compressed")
    try:
        with tarfile.open(path, mode="r:") as archive:
            members = {member.name.removeprefix("./"): member for member in archive}
            if not members:
                raise refuse("it is an empty tar archive.")

            def small_json(name: str, what: str):
                member = members.get(name)
                if member is None or not member.isfile():
                    raise refuse(f"it has no {what} ({name}): it is not an image archive "
                                 "(`docker save` or `podman save` writes one).")
                if member.size > MANIFEST_MAX_BYTES:
                    raise refuse(f"its {name} is {member.size} bytes, too big for {what}.")
                try:
                    return json.loads(archive.extractfile(member).read())
                except (ValueError, UnicodeDecodeError) as exc:
                    raise refuse(f"its {name} is not JSON ({exc}).") from exc

            index = small_json(MANIFEST_NAME, "image manifest")
            if not isinstance(index, list) or len(index) != 1 or not isinstance(index[0], dict):
                count = len(index) if isinstance(index, list) else "no"
                raise refuse(f"it holds {count} images; a runtime image file holds exactly one.")
            entry = index[0]
            layers = entry.get("Layers")
            if not isinstance(entry.get("Config"), str) or not isinstance(layers, list) or not layers:
                raise refuse(f"its {MANIFEST_NAME} names no config or no layers.")
            missing = [name for name in layers if not isinstance(name, str) or name.removeprefix("./") not in members]
            if missing:
                raise refuse(f"it lacks the layer {missing[0]} its {MANIFEST_NAME} names.")
            config = small_json(entry["Config"].removeprefix("./"), "image config")
    except tarfile.TarError as exc:
        raise refuse("it is empty." if path.stat().st_size == 0 else "it is not a tar archive.") from exc
    except (OSError, EOFError) as exc:
        raise refuse(f"it cannot be read as a tar archive ({exc}).") from exc
    labels = (config.get("config") or {}).get("Labels") if isinstance(config, dict) else None
    manifest = manifest_from_labels(labels if isinstance(labels, dict) else {})
    missing = [LABELS[field] for field in MANIFEST_FIELDS if field not in manifest]
    if missing:
        raise refuse(f"its labels lack {', '.join(missing)} (docs/runtime-images.md says how to label a build).",
                     code="manifest_incomplete")
    problems = _manifest_problems(manifest)
    if problems:
        raise refuse(f"its labels have {'; '.join(problems)}.", code="manifest_invalid")
    return manifest


def manifest_from_labels(labels: dict) -> dict:
    """The fields the console keeps, from the image's labels (absent labels stay absent)."""
    manifest = {field: labels[label] for field, label in LABELS.items() if label in labels}
    if "certified" in manifest:
        certified = str(manifest["certified"]).strip().lower()
        manifest["certified"] = {"true": True, "false": False}.get(certified, manifest["certified"])
    return manifest


def _manifest_problems(manifest: dict) -> list[str]:
    """What is wrong with each field, in the words an operator reads (empty when all is well)."""
    problems = []
    name, version = manifest["name"], manifest["version"]
    arch, vendor, certified = manifest["arch"], manifest["accelerator_vendor"], manifest["certified"]
    if not isinstance(name, str) or not name.strip() or len(name) > 100:
        problems.append("a bad name (text of 1 to 100 characters)")
    if not isinstance(version, str) or not _VERSION.match(version) or len(version) > 32:
        problems.append(f"a bad version {version!r} (numbers with dots, like 2.1.0)")
    if not isinstance(arch, str) or not _TOKEN.match(arch) or len(arch) > 32:
        problems.append(f"a bad arch {arch!r} (lower case, like x86_64 or aarch64)")
    if not isinstance(vendor, str) or not _TOKEN.match(vendor) or len(vendor) > 16:
        problems.append(f"a bad accelerator_vendor {vendor!r} (lower case, like nvidia or amd)")
    if not isinstance(certified, bool):
        problems.append(f"a bad certified {certified!r} (true or false)")
    return problems


def runtime_image_import(*, path: Path) -> RuntimeImage:
    """Store a runtime image file and record it; importing the same build again returns its row.

    The file is hard-linked into the store when it is on the same filesystem (and
    copied otherwise), hashed in the same single read, and renamed into place under its
    digest, so the store never holds a partial ``<digest>.img``. A bad file leaves
    nothing behind: no row, no file; nor does a build that lacks what a feature runs inside it
    (``image_contents.NEEDS``: the refusal names each thing and the feature that needs it).
    """
    path = Path(path)
    manifest = runtime_image_manifest_read(path=path)
    directory = store_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".import-", suffix=".part")
    os.close(handle)
    temporary = Path(temporary)
    try:
        digest, size, chunk_hashes = _place_and_hash(source=path, target=temporary)
        final = directory / f"{digest}.img"
        existing = RuntimeImage.objects.filter(digest=digest).first()
        if existing is not None:
            if not runtime_image_held(existing):
                # The row outlived its file: this import brings the file back.
                os.replace(temporary, final)
                if existing.path != str(final):
                    existing.path = str(final)
                    existing.save(update_fields=["path"])
            return existing  # a held build passed the contents check at its import
        if lacks := image_contents.runtime_image_contents_problems(path=temporary, digest=digest):
            raise ValidationError(f"{path.name} is not a runtime image every feature works with: it "
                                  + "; it ".join(lacks) + ". docs/runtime-images.md lists what a build must hold.",
                                  code="incomplete")
        os.replace(temporary, final)
        try:
            with transaction.atomic():
                return RuntimeImage.objects.create(
                    name=manifest["name"].strip(),
                    version=manifest["version"],
                    digest=digest,
                    size_bytes=size,
                    chunk_size=CHUNK_SIZE,
                    chunk_hashes=chunk_hashes,
                    arch=manifest["arch"],
                    accelerator_vendor=manifest["accelerator_vendor"],
                    certified=manifest["certified"],
                    path=str(final),
                )
        except IntegrityError:
            # The same build imported at the same moment by someone else: theirs is ours.
            return RuntimeImage.objects.get(digest=digest)
        except BaseException:
            final.unlink(missing_ok=True)
            raise
    finally:
        temporary.unlink(missing_ok=True)


def _place_and_hash(*, source: Path, target: Path) -> tuple[str, int, list[str]]:
    """Hard-link or copy ``source`` to ``target``; the sha256 of the whole and of each chunk, in one read."""
    target.unlink()
    try:
        os.link(source, target)
        linked = True
    except OSError:  # another filesystem, or a filesystem (or a policy) without hard links
        linked = False
    whole = hashlib.sha256()
    chunk_hashes: list[str] = []
    size = 0
    buffer = bytearray(CHUNK_SIZE)
    view = memoryview(buffer)
    with open(target if linked else source, "rb") as reader:
        writer = None if linked else open(target, "xb")
        try:
            while count := _read_chunk(reader, view):
                piece = view[:count]
                whole.update(piece)
                chunk_hashes.append(hashlib.sha256(piece).hexdigest())
                if writer is not None:
                    writer.write(piece)
                size += count
            if writer is not None:
                writer.flush()
                os.fsync(writer.fileno())  # on disk before the rename makes it visible
        finally:
            if writer is not None:
                writer.close()
    return whole.hexdigest(), size, chunk_hashes


def _read_chunk(reader, view: memoryview) -> int:
    """Fill ``view`` from ``reader`` (short reads happen on pipes and network filesystems); 0 at the end."""
    filled = 0
    while filled < len(view):
        count = reader.readinto(view[filled:])
        if not count:
            break
        filled += count
    return filled


def runtime_image_held(image: RuntimeImage, /) -> bool:
    """Whether the server holds this build's file, whole (it exists and its size matches)."""
    try:
        return os.stat(image.path).st_size == image.size_bytes
    except OSError:
        return False


# -- what the machines need -------------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    """The build one platform's machines need, for all enrolled machines or for one cluster."""

    scope: str  # "enrolled machines" or "cluster NAME"
    cluster_id: int | None
    arch: str
    accelerator_vendor: str
    major: str
    machine_names: tuple[str, ...]
    image: RuntimeImage | None  # None: the server has no certified build of that major for the platform
    held: bool  # the server holds the image's file, whole

    @property
    def platform(self) -> str:
        return f"{self.accelerator_vendor}/{self.arch}"


def runtime_images_needed() -> list[Need]:
    """For each platform of the enrolled machines, and of each cluster's members: the build and whether it is held.

    A platform is a CPU arch plus an accelerator vendor; machines without
    accelerators run no runtime and are left out. Enrolled means the facts were
    read (the arch is known), whatever the machine's health now. A cluster's member
    needs the build it was given when the cluster was made, or else the newest
    certified build of the cluster's major version. A few queries, whatever the
    number of machines.
    """
    builds = list(RuntimeImage.objects.all())
    by_id = {image.pk: image for image in builds}
    plans = [planning.ImageBuild(id=i.pk, arch=i.arch, accelerator_vendor=i.accelerator_vendor, version=i.version,
                                 certified=i.certified) for i in builds]
    enrolled = dict(
        Machine.objects.exclude(state=MachineState.HOST_KEY).exclude(arch="").values_list("id", "name")
    )
    members = list(
        ClusterMember.objects.order_by("cluster__name", "machine__name").values_list(
            "cluster_id", "cluster__name", "cluster__runtime_version", "machine_id", "machine__name", "runtime_image_id"
        )
    )
    platforms = _machine_platforms(set(enrolled) | {m[3] for m in members})
    held: dict[int, bool] = {}

    def need(scope, cluster_id, platform, major, names, image_id) -> Need:
        arch, vendor = platform
        if image_id is None:
            chosen = planning.runtime_for(
                planning.Candidate(id=None, name="", arch=arch, accelerator_vendor=vendor), plans, major=major
            )
            image_id = chosen.id if chosen else None
        image = by_id.get(image_id)
        if image is not None and image.pk not in held:
            held[image.pk] = runtime_image_held(image)
        return Need(scope=scope, cluster_id=cluster_id, arch=arch, accelerator_vendor=vendor, major=major,
                    machine_names=tuple(names), image=image, held=bool(image and held[image.pk]))

    needs = []
    machines_by_platform: dict[tuple[str, str], list[str]] = {}
    for machine_id, name in sorted(enrolled.items(), key=lambda item: item[1]):
        for platform in platforms.get(machine_id, ()):
            machines_by_platform.setdefault(platform, []).append(name)
    for platform, names in sorted(machines_by_platform.items()):
        needs.append(need("enrolled machines", None, platform, DEFAULT_MAJOR, names, None))

    groups: dict[tuple, list[str]] = {}
    for cluster_id, cluster_name, major, machine_id, machine_name, image_id in members:
        for platform in platforms.get(machine_id, ()):
            groups.setdefault((cluster_name, cluster_id, platform, major, image_id), []).append(machine_name)
    for (cluster_name, cluster_id, platform, major, image_id), names in sorted(groups.items(), key=lambda g: g[0][:3]):
        needs.append(need(f"cluster {cluster_name}", cluster_id, platform, major, names, image_id))
    return needs


def _machine_platforms(machine_ids: Iterable[int]) -> dict[int, list[tuple[str, str]]]:
    """Each machine's platforms, (arch, vendor): one per accelerator vendor it holds, none without accelerators."""
    rows = (
        Accelerator.objects.filter(machine_id__in=list(machine_ids))
        .values_list("machine_id", "machine__arch", "vendor")
        .distinct()
    )
    platforms: dict[int, set[tuple[str, str]]] = {}
    for machine_id, arch, vendor in rows:
        if arch and vendor:
            platforms.setdefault(machine_id, set()).add((arch.lower(), vendor.lower()))
    return {machine_id: sorted(found) for machine_id, found in platforms.items()}


# -- the first copy: download tokens ----------------------------------------------------------


@dataclass(frozen=True)
class ImageGrant:
    """What a download token allows: one image, to one machine, for one cluster's start."""

    digest: str
    cluster_id: int
    machine_id: int


def image_download_token(*, grant: ImageGrant, lifetime: float) -> str:
    """A signed token that lets the machine fetch the image from the server for ``lifetime`` seconds
    (the fetch's own time limit, so no start leaves a token behind that outlives it)."""
    payload = {"digest": grant.digest, "cluster": grant.cluster_id, "machine": grant.machine_id,
               "expires": int(time.time() + lifetime)}
    return signing.dumps(payload, salt=TOKEN_SALT, compress=False)


def image_download_token_check(token: str) -> ImageGrant | None:
    """The grant of a token this server signed and that has not expired; None for any other."""
    try:
        payload = signing.loads(token or "", salt=TOKEN_SALT)
    except signing.BadSignature:
        return None
    if not isinstance(payload, dict):
        return None
    digest, cluster_id, machine_id, expires = (payload.get(k) for k in ("digest", "cluster", "machine", "expires"))
    if not isinstance(digest, str) or not _DIGEST.match(digest) or not all(type(v) is int for v in (cluster_id, machine_id, expires)):
        return None
    if expires <= time.time():
        return None
    return ImageGrant(digest=digest, cluster_id=cluster_id, machine_id=machine_id)


def image_download_refusal(token: str, *, digest: str) -> str | None:
    """Why the holder of ``token`` may not download ``digest`` now, in the machine's log's words; None when it may.

    The token must be ours, unexpired and for this image, and its machine must still be a member of
    its cluster, which is not being deleted: deleting the cluster (or taking the machine out) ends it.
    """
    grant = image_download_token_check(token)
    if grant is None:
        return "Send a valid image token as Authorization: Bearer (a token lasts as long as its start's download)."
    if grant.digest != digest:
        return "This token is for another image."
    member_of_live_cluster = ClusterMember.objects.filter(cluster_id=grant.cluster_id, machine_id=grant.machine_id).exclude(
        cluster__state=ClusterState.DELETING).exists()
    if not member_of_live_cluster:
        return "This token's cluster was deleted, or its machine is no longer in it."
    return None


def runtime_files(member: ClusterMember) -> list[ServerFile]:
    """What a member needs before its runtime starts: its build of the runtime image, as the transfer layer ships it."""
    image = member.runtime_image
    if image is None:
        return []
    if "chunk_hashes" in image.get_deferred_fields():
        image = RuntimeImage.objects.get(pk=image.pk)  # the pages leave the chunk list out; a transfer needs it
    grant = ImageGrant(digest=image.digest, cluster_id=member.cluster_id, machine_id=member.machine_id)
    return [ServerFile(spec=FileSpec(digest=grant.digest, size=image.size_bytes, chunk_size=image.chunk_size, chunk_hashes=image.chunk_hashes),
                       what="the runtime image", download_path=f"/agent/images/{grant.digest}/",
                       token=lambda lifetime: image_download_token(grant=grant, lifetime=lifetime))]
