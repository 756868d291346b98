"""What a runtime image file says of itself: the labels of a docker-archive.

A runtime image is a container image archive as ``docker save`` and ``podman
save`` write it (and as ``docker load`` / ``podman load`` read it): a tar
holding ``manifest.json`` (one image: its config and its layers) and the
image's config, whose labels name the build::

    org.fadenstack.runtime.name                e.g. "NVIDIA x86_64 Runtime"
    org.fadenstack.runtime.version             e.g. "2.1.0"
    org.fadenstack.runtime.arch                x86_64 | aarch64
    org.fadenstack.runtime.accelerator-vendor  nvidia | amd
    org.fadenstack.runtime.certified           "true" | "false"
    org.fadenstack.runtime.ray, .python        optional: the executables (ray, python3)
    org.fadenstack.runtime.command             optional: the container's command, a JSON
                                               list (default: a shell that only waits)

``read_labels`` returns them as the manifest the agent records
(``{"name", "version", "arch", "accelerator_vendor", "certified", "tag",
"image_id"}``: ``image_id`` is the sha256 of the image's config, the ID an
engine gives the image once loaded).
The console reads the same labels when it imports a build.
"""

import hashlib
import json
import tarfile

from .protocol import NOT_RETRYABLE, AgentError

JSON_MAX = 1024 * 1024
LABEL = "org.fadenstack.runtime."
FIELDS = ("name", "version", "arch", "accelerator_vendor", "certified",
          "ray", "python")  # the last two optional: the executables in the image (default ray, python3)


def _refuse(path: str, reason: str) -> AgentError:
    return AgentError(NOT_RETRYABLE, "%s is not a runtime image: %s" % (path, reason))


def _unprefixed(name: str) -> str:
    return name[2:] if name.startswith("./") else name


def _json(tar, members: dict, name: str, path: str):
    """The member ``name`` parsed, and its raw bytes."""
    name = _unprefixed(name)
    member = members.get(name)
    if member is None or not member.isfile():
        raise _refuse(path, "it has no %s (an image archive, as `docker save` writes one, has)" % name)
    if member.size > JSON_MAX:
        raise _refuse(path, "its %s is %d bytes, too big" % (name, member.size))
    raw = tar.extractfile(member).read()
    try:
        return json.loads(raw.decode("utf-8")), raw
    except (UnicodeDecodeError, ValueError) as exc:
        raise _refuse(path, "its %s is not valid JSON: %s" % (name, exc))


def read_labels(path: str) -> dict:
    """The build's manifest from the archive's labels, or ``not_retryable`` in plain words."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            members = {_unprefixed(member.name): member for member in tar}
            index, _ = _json(tar, members, "manifest.json", path)
            if not isinstance(index, list) or len(index) != 1 or not isinstance(index[0], dict) \
                    or not isinstance(index[0].get("Config"), str):
                raise _refuse(path, "its manifest.json does not name exactly one image and its config")
            config, raw_config = _json(tar, members, index[0]["Config"], path)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise _refuse(path, "not a readable tar archive (%s)" % exc)
    config_digest = hashlib.sha256(raw_config).hexdigest()
    labels = ((config if isinstance(config, dict) else {}).get("config") or {}).get("Labels") or {}
    manifest = {field: labels[LABEL + field.replace("_", "-")] for field in FIELDS
                if LABEL + field.replace("_", "-") in labels}
    if not manifest.get("name") or not manifest.get("version"):
        raise _refuse(path, "its labels lack %sname or %sversion" % (LABEL, LABEL))
    if "certified" in manifest:
        manifest["certified"] = str(manifest["certified"]).lower() == "true"
    command = labels.get(LABEL + "command")
    if command is not None:
        try:
            manifest["command"] = json.loads(command)
        except ValueError:
            raise _refuse(path, "its label %scommand is not a JSON list of strings" % LABEL)
    tags = index[0].get("RepoTags")
    manifest["tag"] = tags[0] if isinstance(tags, list) and tags and isinstance(tags[0], str) else None
    manifest["image_id"] = config_digest  # what an engine calls the image once loaded: its config's sha256
    return manifest
