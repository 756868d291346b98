"""Placed models in the store: a tree of hard links to blobs, and a manifest.

A model's files arrive as blobs (``blob fetch`` from the server or another
machine, or ``model download`` from the hub); placing it makes
``<store>/models/<org>--<name>/<revision>/<path>`` as hard links to those
blobs (no copy, no extra room), the directory layout an engine reads, and then
writes ``<store>/models/.manifests/<org>--<name>@<revision>.json``.  The
manifest is written last, in one step, so a model counts as placed only once
every file is in its tree.  Manifests live apart from the trees so that no
file of a model can stand where its manifest is.

Hugging Face forbids ``--``, ``..`` and a leading ``.`` or ``-`` in repo
names, so ``<org>--<name>``, ``.manifests`` and ``@`` cannot collide.
"""

import errno
import json
import os
import re
import shutil
import time

from .blobstore import BlobFiles, check_digest
from .files import Locked, fsync_dir, read_json, remove_quietly, write_json
from .protocol import BAD_INPUT, NOT_RETRYABLE, RETRYABLE, AgentError

NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
REVISION_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,126}[A-Za-z0-9])?$")
MAX_PATH, MAX_PART, MAX_FILES, MAX_SIZE = 1024, 255, 20000, 1 << 50
MANIFESTS, STAGING, LOCK = ".manifests", ".staging", ".lock"
LOCK_WAIT = 120.0


def models_dir(store: str) -> str:
    return os.path.join(store, "models")


# ------------------------------------------------------------------ checking the spec


def check_repo(repo) -> str:
    """``org/name`` as the hub spells it; bad_input for anything a path could abuse."""
    parts = repo.split("/") if isinstance(repo, str) else []
    if len(parts) != 2 or not all(NAME_RE.match(p) and "--" not in p and ".." not in p for p in parts):
        raise AgentError(BAD_INPUT, "the repo must be \"org/name\" as on the hub (letters, digits, '-', '_', "
                                    "'.'; no '--' or '..'; at most 96 characters each), got %s"
                         % json.dumps(repo)[:120])
    return repo


def check_revision(revision) -> str:
    """A commit sha, branch or tag without '/' (one directory level); bad_input otherwise."""
    if not isinstance(revision, str) or not REVISION_RE.match(revision) or ".." in revision:
        raise AgentError(BAD_INPUT, "the revision must be a commit sha, branch or tag of letters, digits, '-', '_' "
                                    "and '.' (no '/' or '..'; at most 128 characters), got %s"
                         % json.dumps(revision)[:160])
    return revision


def check_path(path) -> str:
    """A relative file path inside the model: no absolute path, no '.' or '..' part, no control character."""
    def bad(why):
        return AgentError(BAD_INPUT, "the file path %s is refused: %s" % (json.dumps(path)[:200], why))

    if not isinstance(path, str) or not path:
        raise bad("it must be a non-empty string")
    if len(path) > MAX_PATH:
        raise bad("longer than %d characters" % MAX_PATH)
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise bad("it holds a control character")
    if path.startswith("/"):
        raise bad("it is absolute")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise bad("it has an empty, '.' or '..' part")
        if len(part.encode("utf-8", "surrogatepass")) > MAX_PART:
            raise bad("a part is longer than %d bytes" % MAX_PART)
    return path


def check_files(files) -> list:
    """The spec's ``files`` as ``[{"path", "digest", "size"}]``, each path once, none inside another."""
    if not isinstance(files, list) or not files or len(files) > MAX_FILES:
        raise AgentError(BAD_INPUT, "\"files\" must be a list of 1 to %d {\"path\", \"digest\", \"size\"}"
                         % MAX_FILES)
    checked, dirs = [], set()
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            raise AgentError(BAD_INPUT, "files[%d] must be an object {\"path\", \"digest\", \"size\"}" % i)
        path = check_path(entry.get("path"))
        digest = check_digest(entry.get("digest"), "files[%d].digest" % i)
        size = entry.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SIZE:
            raise AgentError(BAD_INPUT, "files[%d].size must be a whole number of bytes, got %s"
                             % (i, json.dumps(size)[:40]))
        checked.append({"path": path, "digest": digest, "size": size})
        parts = path.split("/")
        dirs.update("/".join(parts[:n]) for n in range(1, len(parts)))
    paths = [f["path"] for f in checked]
    if len(set(paths)) != len(paths):
        raise AgentError(BAD_INPUT, "a file path is listed twice: %s"
                         % sorted({p for p in paths if paths.count(p) > 1})[0])
    clash = sorted(dirs & set(paths))
    if clash:
        raise AgentError(BAD_INPUT, "%s is listed as a file and as a folder of other files" % clash[0])
    return checked


def check_model(spec: dict) -> dict:
    """``{"repo", "revision", "files"}`` checked and normalised (the manifest's own keys)."""
    return {"repo": check_repo(spec.get("repo")), "revision": check_revision(spec.get("revision")),
            "files": check_files(spec.get("files"))}


# ------------------------------------------------------------------ where a model is


class ModelPaths:
    """The tree and the manifest of one model revision in one store."""

    def __init__(self, store: str, repo: str, revision: str):
        self.store, self.repo, self.revision = store, repo, revision
        self.root = models_dir(store)
        self.repo_dir = os.path.join(self.root, repo.replace("/", "--"))
        self.tree = os.path.join(self.repo_dir, revision)
        self.manifest = os.path.join(self.root, MANIFESTS, "%s@%s.json" % (repo.replace("/", "--"), revision))


def models_lock(store: str) -> Locked:
    """One model command at a time changes the store's models (a remove must not take a blob a place links)."""
    return Locked(os.path.join(models_dir(store), LOCK), LOCK_WAIT,
                  "another model command kept the store's models busy for %d s; try again" % LOCK_WAIT)


def read_manifests(store: str) -> list:
    """Every placed model's manifest, sorted by repo and revision; unreadable ones are skipped."""
    directory = os.path.join(models_dir(store), MANIFESTS)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for name in names:
        data = read_json(os.path.join(directory, name)) if name.endswith(".json") else None
        try:
            model = check_model(data or {})
        except AgentError:
            continue
        if ModelPaths(store, model["repo"], model["revision"]).manifest == os.path.join(directory, name):
            found.append(dict(data, **model))
    return found


def summary(store: str, manifest: dict) -> dict:
    """What ``model place`` and ``model list`` say of a placed model."""
    return {"repo": manifest["repo"], "revision": manifest["revision"],
            "path": ModelPaths(store, manifest["repo"], manifest["revision"]).tree,
            "bytes": sum(f["size"] for f in manifest["files"]), "files": len(manifest["files"]),
            "placed_at": manifest.get("placed_at")}


# ------------------------------------------------------------------ placing


def missing_blobs(store: str, files: list) -> list:
    """The files whose blob is not complete in the store; a blob of another size is refused."""
    missing = []
    for f in files:
        try:
            size = os.stat(BlobFiles(store, f["digest"]).path).st_size
        except OSError:
            missing.append(f)
            continue
        if size != f["size"]:
            raise AgentError(NOT_RETRYABLE, "the store's blob %s has %d bytes, but %s should have %d: the spec "
                                            "names another file" % (f["digest"][:12], size, f["path"], f["size"]))
    return missing


def place(store: str, model: dict) -> dict:
    """Link a model's tree to its blobs and write its manifest last (call under ``models_lock``).

    Placing the same model again repairs its tree and keeps its manifest;
    placing other files under the same revision replaces the old ones and
    frees the blobs only the old manifest named."""
    missing = missing_blobs(store, model["files"])
    if missing:
        names = ", ".join("%s (%s)" % (f["path"], f["digest"][:12]) for f in missing[:5])
        more = " and %d more" % (len(missing) - 5) if len(missing) > 5 else ""
        raise AgentError(NOT_RETRYABLE, "%s at %s cannot be placed: %d of its files are not complete in the store "
                                        "%s: %s%s; fetch them first"
                         % (model["repo"], model["revision"], len(missing), store, names, more))
    paths = ModelPaths(store, model["repo"], model["revision"])
    old = read_json(paths.manifest)
    same = old is not None and _listed(old) == _listed(model)
    if old is not None and not same:
        remove_quietly(paths.manifest)     # the tree is about to change: it does not count meanwhile
        fsync_dir(os.path.dirname(paths.manifest))
    _link_tree(paths, model["files"])
    manifest = dict(model, bytes=sum(f["size"] for f in model["files"]),
                    placed_at=old.get("placed_at") if same else round(time.time(), 3))
    if not same:
        write_json(paths.manifest, manifest)
        if old is not None:
            free_unreferenced(store, _digests(old) - _digests(model))
    return summary(store, manifest)


def _listed(manifest) -> list:
    files = manifest.get("files") if isinstance(manifest, dict) else None
    try:
        return sorted((f["path"], f["digest"], f["size"]) for f in files)
    except (TypeError, KeyError):
        return []


def _digests(manifest) -> set:
    return {digest for _, digest, _ in _listed(manifest)}


def _link_tree(paths: ModelPaths, files: list) -> None:
    """Make every file a hard link to its blob and drop what the tree holds besides."""
    staging = os.path.join(paths.root, STAGING)
    os.makedirs(staging, exist_ok=True)
    for name in os.listdir(staging):       # a link a crashed place left would hold its blob's bytes for ever
        remove_quietly(os.path.join(staging, name))
    os.makedirs(paths.tree, exist_ok=True)
    wanted = set()
    for i, f in enumerate(files):
        target = os.path.join(paths.tree, *f["path"].split("/"))
        wanted.add(target)
        blob = BlobFiles(paths.store, f["digest"]).path
        if os.path.isfile(target) and not os.path.islink(target) and os.path.samefile(target, blob):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        tmp = os.path.join(staging, "%d-%d" % (os.getpid(), i))
        remove_quietly(tmp)
        try:
            os.link(blob, tmp)
        except OSError as exc:
            kind = NOT_RETRYABLE if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK) else RETRYABLE
            raise AgentError(kind, "cannot link %s to its blob in %s: %s (the store must be one file system that "
                                   "allows hard links)" % (f["path"], paths.store, exc.strerror or exc))
        os.replace(tmp, target)
    _drop_extras(paths.tree, wanted)
    fsync_dir(paths.tree)


def _drop_extras(tree: str, wanted: set) -> None:
    for directory, dirs, names in os.walk(tree, topdown=False):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            path = os.path.join(directory, name)
            if path not in wanted:
                remove_quietly(path)
        if directory != tree:
            try:
                os.rmdir(directory)         # only when empty
            except OSError:
                pass


# ------------------------------------------------------------------ removing


def remove(store: str, repo: str, revision: str) -> int:
    """Remove a model's manifest (first), its tree, and the blobs no other manifest names; bytes freed.

    Only digests the removed manifest lists are candidates: the blob
    directory also holds runtime images and files on their way."""
    paths = ModelPaths(store, repo, revision)
    manifest = read_json(paths.manifest)
    if remove_quietly(paths.manifest):
        fsync_dir(os.path.dirname(paths.manifest))
    if os.path.isdir(paths.tree) and not os.path.islink(paths.tree):
        shutil.rmtree(paths.tree)
    try:
        os.rmdir(paths.repo_dir)            # only when no other revision is left
    except OSError:
        pass
    return free_unreferenced(store, _digests(manifest)) if manifest else 0


def named_digests(store: str) -> set:
    """The blobs the placed models' manifests name: model files, never runtime images."""
    named = set()
    for manifest in read_manifests(store):
        named |= _digests(manifest)
    return named


def free_unreferenced(store: str, digests: set) -> int:
    """Remove the blobs among ``digests`` that no manifest names; the bytes that left the disk."""
    named = named_digests(store)
    freed = 0
    for digest in sorted(digests - named):
        path = BlobFiles(store, digest).path
        try:
            st = os.stat(path)
        except OSError:
            continue
        if remove_quietly(path) and st.st_nlink == 1:
            freed += st.st_size             # a link left elsewhere (an old tree) still holds the bytes
    return freed

