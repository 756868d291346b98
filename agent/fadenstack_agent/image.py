"""``image fetch|verify|load|list``: runtime images, a thin layer over blobs.

A runtime image is a blob (``blob``) that is a tar archive whose first member
is ``manifest.json``.  Fetching, verifying and serving it are the blob
commands' code, speaking of "the image"; what is the image's own is here:
reading the manifest, loading the container image into Docker or Podman
(``engines.load_image``), and ``<store>/runtime/loaded.json``, the record of
the image ``image load`` read last (``{"digest", "path", "manifest",
"driver", "image_ref", "loaded_at"}``), which ``runtime start`` checks.
``image serve`` is the blob server (``blobserve``).
"""

import json
import os
import tarfile
import time

from . import blob
from .blobstore import check_digest, list_blobs
from .cli import DIGEST, STORE, command, group
from .containers import ENGINES, Engine
from .engines import DRIVER, chosen_driver, has_image, load_image
from .files import load_machine_config, read_json, runtime_dir, store_dir, write_json
from .protocol import NOT_RETRYABLE, AgentError

MANIFEST_MAX = 1024 * 1024
IMAGE_DIGEST = (DIGEST[0], dict(DIGEST[1], help="the image's sha256"))

group("image", help="the runtime image store")


def loaded_path(store: str) -> str:
    return os.path.join(runtime_dir(store), "loaded.json")


def read_loaded(store: str) -> dict:
    """The record of the loaded image ({} when none was loaded)."""
    return read_json(loaded_path(store)) or {}


def read_manifest(path: str) -> dict:
    """The ``manifest.json`` that must be the first member of a runtime image."""
    try:
        with tarfile.open(path, mode="r|") as tar:
            member = tar.next()
            if member is None or member.name.lstrip("./") != "manifest.json" or not member.isfile():
                raise AgentError(NOT_RETRYABLE, "%s is not a runtime image: its first member is %r, not "
                                                "manifest.json" % (path, member.name if member else None))
            if member.size > MANIFEST_MAX:
                raise AgentError(NOT_RETRYABLE, "%s: manifest.json is %d bytes, too big" % (path, member.size))
            raw = tar.extractfile(member).read()
    except (tarfile.TarError, OSError) as exc:
        # Python 3.9's tarfile says "seeking backwards" where later ones find no member.
        raise AgentError(NOT_RETRYABLE, "%s is not a runtime image (not a readable tar archive: %s)"
                         % (path, exc))
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise AgentError(NOT_RETRYABLE, "%s: manifest.json is not valid JSON: %s" % (path, exc))
    if not isinstance(manifest, dict) or not manifest.get("name") or not manifest.get("version"):
        raise AgentError(NOT_RETRYABLE, "%s: manifest.json must be an object with at least \"name\" "
                                        "and \"version\"" % path)
    return manifest


# ------------------------------------------------------------------ commands


@command("image", "fetch", args=[STORE])
def cmd_fetch(args, out) -> int:
    """``image fetch [--store PATH]`` with the JSON spec on stdin: ``blob fetch``
    of a runtime image (the same spec, progress and result; the messages say
    "the runtime image")."""
    return blob.fetch(args, out, noun="image", what="the runtime image")


@command("image", "verify", args=[STORE, IMAGE_DIGEST])
def cmd_verify(args, out) -> int:
    """``image verify --digest D [--store PATH]``: ``blob verify`` of an image.

    Result: ``{"ok": true, "digest", "size", "seconds"}``.
    """
    return blob.verify(args, out, noun="image")


@command("image", "load", args=[STORE, IMAGE_DIGEST, DRIVER])
def cmd_load(args, out) -> int:
    """``image load --digest D [--driver docker|podman|process] [--store PATH]``:
    read the finished image's manifest, load its container image into the
    engine when the runtime driver (chosen as for ``runtime start``) is
    ``docker`` or ``podman``, and record it as the loaded runtime in
    ``<store>/runtime/loaded.json``.

    Result: ``{"manifest": {...}, "digest", "path", "driver": name | null,
    "image_ref": the engine's reference | null, "already_loaded": bool}``.
    Loading D again into the same engine is a no-op.  Not a runtime image (no
    manifest first, no ``image.tar`` for an engine), no such image, or the
    engine refusing it (in its own words): ``not_retryable``; a partial one:
    ``retryable``.
    """
    digest = check_digest(args.digest)
    store = store_dir(args.store)
    path = blob.complete_path(store, digest, noun="image")
    manifest = read_manifest(path)
    config = load_machine_config()
    driver = chosen_driver(config, args.driver)
    image_ref = None
    if driver in ENGINES:
        engine = Engine.from_config(driver, config)
        before = read_loaded(store)
        if (before.get("digest") == digest and before.get("driver") == driver and before.get("image_ref")
                and has_image(engine, before["image_ref"])):
            return out.result(manifest=manifest, digest=digest, path=path, driver=driver,
                              image_ref=before["image_ref"], already_loaded=True)
        image_ref = load_image(engine, store, path, digest, out)
        out.log("%s loaded the runtime image %s as %s" % (driver, digest[:12], image_ref))
    record = {"digest": digest, "path": path, "manifest": manifest, "driver": driver, "image_ref": image_ref,
              "loaded_at": round(time.time(), 3)}
    write_json(loaded_path(store), record)
    return out.result(manifest=manifest, digest=digest, path=path, driver=driver, image_ref=image_ref,
                      already_loaded=False)


@command("image", "list", args=[STORE])
def cmd_list(args, out) -> int:
    """``image list [--store PATH]``: the blobs held, complete and partial, with
    which of them is the loaded image.

    Result: ``{"store", "images": [{"digest", "state": "complete"|"partial",
    "path", "size", "verified_bytes", "loaded"}]}``.
    """
    store = store_dir(args.store)
    loaded = read_loaded(store).get("digest")
    images = [dict(held, loaded=held["digest"] == loaded and held["state"] == "complete")
              for held in list_blobs(store)]
    return out.result(store=store, images=images)
