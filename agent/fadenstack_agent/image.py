"""``image fetch|verify|load|list|remove``: runtime images, a thin layer over blobs.

A runtime image is a blob (``blob``) that is a container image archive
(docker-archive) labelled with its build (``imagearchive``).  Fetching, verifying and serving it are the blob
commands' code, speaking of "the image"; what is the image's own is here:
reading the manifest, loading the container image into Docker or Podman
(``engines.load_image``), and ``<store>/runtime/loaded.json``, the record of
the image ``image load`` read last (``{"digest", "path", "manifest",
"driver", "image_ref", "loaded_at"}``), which ``runtime start`` checks.
``image serve`` is the blob server (``blobserve``).
"""

import os
import time

from . import blob, imagearchive
from .blobstore import check_digest, list_blobs
from .cli import DIGEST, STORE, command, group
from .containers import ENGINES, Engine
from .engines import DRIVER, chosen_driver, has_image, load_image, run_engine
from .files import load_machine_config, read_json, remove_quietly, runtime_dir, store_dir, write_json
from .modelstore import named_digests
from .protocol import NOT_RETRYABLE, AgentError

IMAGE_DIGEST = (DIGEST[0], dict(DIGEST[1], help="the image's sha256"))

group("image", help="the runtime image store")


def loaded_path(store: str) -> str:
    return os.path.join(runtime_dir(store), "loaded.json")


def read_loaded(store: str) -> dict:
    """The record of the loaded image ({} when none was loaded)."""
    return read_json(loaded_path(store)) or {}


def read_manifest(path: str) -> dict:
    """What the runtime image says of itself: its labels (``imagearchive``)."""
    return imagearchive.read_labels(path)


def holds_build(engine: Engine, manifest: dict) -> bool:
    """The engine holds this very build under its tag already (the image ID is its config's sha256):
    loading it again would change nothing, after a store was cleared, say."""
    tag, image_id = manifest.get("tag"), manifest.get("image_id")
    if not tag or not image_id:
        return False
    code, out, _ = run_engine(engine.image_exists_argv(tag))
    return code == 0 and out.strip().split(":")[-1] == image_id


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
    labels), no such image, or the engine refusing it (in its own words):
    ``not_retryable``; a partial one: ``retryable``.
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
        if holds_build(engine, manifest):
            image_ref = manifest["tag"]
            out.log("%s holds the runtime image %s already, as %s" % (driver, digest[:12], image_ref))
        else:
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


def running_digest(store: str):
    """The image the started runtime runs (``runtime start``'s record), or None when none is started."""
    state = read_json(os.path.join(runtime_dir(store), "state.json")) or {}
    return state.get("digest") if state.get("state") == "started" else None


@command("image", "remove", args=[STORE])
def cmd_remove(args, out) -> int:
    """``image remove [--store PATH]``: free the runtime images a deleted cluster left in the store (agent 0.9).

    Every complete blob that is a runtime image (its labels read: model files are not) and that no placed
    model names is removed, except the one the started runtime runs, which is kept and named. With Docker
    or Podman, the engine's copy of the loaded image goes too (``rmi``, when no container uses it), and the
    record of the loaded image with it. Partial fetches are left alone.

    Result: ``{"store", "removed": [{"digest", "size"}], "kept": [{"digest", "why"}], "freed": bytes,
    "engine_removed": [refs], "warnings"}``.
    """
    store = store_dir(args.store)
    running = running_digest(store)
    named = named_digests(store)
    removed, kept, warnings, freed = [], [], [], 0
    for held in list_blobs(store):
        digest = held["digest"]
        if held["state"] != "complete" or digest in named:
            continue
        try:
            read_manifest(held["path"])
        except AgentError:
            continue  # not a runtime image: a model's file on its way, or something else
        if digest == running:
            kept.append({"digest": digest, "why": "the started runtime runs it"})
            continue
        size = os.stat(held["path"]).st_size
        if remove_quietly(held["path"]):
            removed.append({"digest": digest, "size": size})
            freed += size
    engine_removed = []
    loaded = read_loaded(store)
    if loaded.get("digest") in {item["digest"] for item in removed}:
        if loaded.get("driver") in ENGINES and loaded.get("image_ref"):
            engine = Engine.from_config(loaded["driver"], load_machine_config())
            code, _, err = run_engine(engine.argv("rmi", loaded["image_ref"]))
            if code == 0:
                engine_removed.append(loaded["image_ref"])
            else:
                warnings.append("%s kept %s: %s" % (loaded["driver"], loaded["image_ref"], err.strip()[-300:]))
        remove_quietly(loaded_path(store))
    for warning in warnings:
        out.log(warning)
    return out.result(store=store, removed=removed, kept=kept, freed=freed, engine_removed=engine_removed,
                      warnings=warnings)
