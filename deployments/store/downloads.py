"""A model into the server's store: the job that downloads it from the hub, and the import of a directory.

Both end the same way: every file checked (against the hub's digest when there is one), put in the
store under its sha256 with its chunks' sha256 (the transfer layer checks them on the machines),
linked into the model's tree, and the model's facts read from the files. A download that stops
(a dropped link, a worker that died, Try again) resumes from the partial files huggingface_hub left.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from django.db import transaction
from django.utils import timezone

from console import live
from console.choices import ErrorKind
from console.jobs import JobContext, JobError, Operation, Step
from console.lifecycle import InvalidTransition, sources_of
from console.ticker import Ticker
from deployments.choices import MODEL_TRANSITIONS, ModelState
from deployments.models import ModelFile, StoredModel
from deployments.store import disk, facts, hub
from deployments.store.hub_token import hf_token

KIND = "model.download"
LIST = Step("Ask the hub for the files")
SPACE = Step("Check the room in the store")
FETCH = Step("Download the files")
CHECK = Step("Check every file's digest")
FACTS = Step("Read what the files say")
DOWNLOAD = Operation(KIND, (LIST, SPACE, FETCH, CHECK, FACTS))

PUSH_EVERY = 0.5


def model_changed(model: StoredModel | int, part: str = "") -> None:
    """Push the model's page and its row of the Models list."""
    pk = model if isinstance(model, int) else model.pk
    live.push(f"model:{pk}", part=part)
    live.push("models", part=str(pk))


def model_transition(model: StoredModel | int, *, to: str, reason: str = "", only_from=None, **fields) -> bool:
    """The one way a model in the store changes state: checked against the table in the UPDATE itself (the
    download job, the reaper and Try again write the same row). ``only_from`` narrows the states it moves
    from (another is left as it is: False); without it a move the table forbids raises InvalidTransition.
    Nothing is written when it does not move; a model deleted meanwhile is left gone (False)."""
    pk = model if isinstance(model, int) else model.pk
    sources = [s for s in sources_of(MODEL_TRANSITIONS, to) if only_from is None or s in only_from]
    if StoredModel.objects.filter(pk=pk, state__in=sources).update(state=to, state_reason=reason, **fields):
        return True
    current = StoredModel.objects.filter(pk=pk).first()
    if current is not None and only_from is None:
        raise InvalidTransition(f"{current} cannot go from {current.get_state_display()} to {ModelState(to).label}.")
    return False


class Meter(Ticker):
    """The bar: the bytes on disk in the download folder (partial files included) plus what the store
    already held, and the rate of late, written and pushed twice a second."""

    tick_on_exit = True

    def __init__(self, model: StoredModel, folder: Path, held: int):
        super().__init__(f"model-download-{model.pk}")
        self.model, self.folder, self.held = model, folder, held
        self._last: tuple[float, int] | None = None
        self.rate = 0.0

    def every(self) -> float:
        return PUSH_EVERY

    def on_disk(self) -> int:
        total = 0
        for path in self.folder.rglob("*"):
            try:
                if path.is_file() and not path.name.endswith((".lock", ".metadata")):
                    total += path.stat().st_size
            except OSError:
                continue  # renamed under us: counted on the next tick
        return total

    def tick(self) -> None:
        done = min(self.held + self.on_disk(), self.model.bytes_total or 1 << 62)
        now = time.monotonic()
        if self._last is not None and now > self._last[0]:
            moment = max(done - self._last[1], 0) / (now - self._last[0])
            self.rate = moment if not self.rate else 0.5 * self.rate + 0.5 * moment
        self._last = (now, done)
        StoredModel.objects.filter(pk=self.model.pk).update(bytes_done=done, rate=self.rate)
        model_changed(self.model)


@dataclass
class _Todo:
    row: ModelFile
    hub_file: hub.HubFile


def model_download_run(ctx: JobContext, *, model_id: int) -> None:
    model = StoredModel.objects.get(pk=model_id)
    try:
        _download(ctx, model)
    except hub.HubError as exc:
        _failed(model, exc.message)
        raise JobError(exc.message, kind=exc.kind) from None
    except JobError as exc:
        _failed(model, exc.message)
        raise
    except OSError as exc:  # a full disk, a folder we may not write: the system's own words
        message = f"The store at {disk.root()} could not be written: {exc.strerror or exc}."
        _failed(model, message)
        raise JobError(message, kind=ErrorKind.NOT_RETRYABLE) from None


def _download(ctx: JobContext, model: StoredModel) -> None:
    token = hf_token()
    LIST.always(ctx, hub.endpoint())
    listing = hub.listing(model.repo, model.revision, token=token)
    for f in listing.files:
        if problem := disk.path_problem(f.path):
            raise JobError(f"{model.repo}: {problem}", kind=ErrorKind.NOT_RETRYABLE)
    rows = _files_record(model, listing)
    todo = [_Todo(row=rows[f.path], hub_file=f) for f in listing.files if not _held(rows[f.path], f)]
    held = listing.size - sum(t.hub_file.size for t in todo)

    folder = disk.downloads_dir(model.pk)
    SPACE.always(ctx)
    on_disk = Meter(model, folder, 0).on_disk() if folder.is_dir() else 0
    disk.ensure_dirs()
    if problem := disk.disk_space_problem(max(listing.size - held - on_disk, 0)):
        raise JobError(problem, kind=ErrorKind.NOT_RETRYABLE)
    ctx.detail(f"{disk.gb(listing.size - held)} to download; {disk.gb(held)} already in the store")

    FETCH.always(ctx, f"{len(todo)} of {len(listing.files)} files")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    downloaded: list[tuple[_Todo, Path]] = []
    with Meter(model, folder, held):
        for item in todo:
            ctx.check_cancel()
            downloaded.append((item, hub.download(listing, item.hub_file, into=folder, token=token)))

    CHECK.always(ctx)
    for item, path in downloaded:
        _check_and_keep(item, path)

    FACTS.always(ctx)
    _finish(model, folder)


def _files_record(model: StoredModel, listing: hub.HubListing) -> dict[str, ModelFile]:
    with transaction.atomic():
        StoredModel.objects.filter(pk=model.pk).update(commit=listing.commit, bytes_total=listing.size)
        model.commit, model.bytes_total = listing.commit, listing.size
        model.files.exclude(path__in=[f.path for f in listing.files]).delete()
        rows = {row.path: row for row in model.files.all()}
        for f in listing.files:
            digest = f.sha256 or f.blob_id
            row = rows.get(f.path)
            if row is None or row.size != f.size or row.hub_digest != digest:
                rows[f.path], _ = ModelFile.objects.update_or_create(
                    model=model, path=f.path,
                    defaults={"size": f.size, "hub_digest": digest, "sha256": "", "chunk_hashes": [], "chunk_size": 0})
    model_changed(model)
    return rows


def _held(row: ModelFile, f: hub.HubFile) -> bool:
    """The store holds this file already: from an earlier run of this download, or another revision."""
    if row.sha256 and disk.blob_path(row.sha256).is_file():
        return True
    if f.sha256 and disk.blob_path(f.sha256).is_file():
        twin = ModelFile.objects.filter(sha256=f.sha256).exclude(chunk_hashes=[]).first()
        if twin is not None:
            ModelFile.objects.filter(pk=row.pk).update(sha256=twin.sha256, chunk_size=twin.chunk_size,
                                                       chunk_hashes=twin.chunk_hashes)
            return True
    return False


def _check_and_keep(item: _Todo, path: Path) -> None:
    hashed = disk.hash_file(path)
    f = item.hub_file
    expected, found, kind = (f.sha256, hashed.sha256, "sha256") if f.sha256 else (f.blob_id, hashed.blob_id, "git blob id")
    if hashed.size != f.size or (expected and found != expected):
        path.unlink(missing_ok=True)
        raise JobError(f"{f.path} does not match the hub: its {kind} is {found[:12]}… and {hashed.size} bytes, the hub "
                       f"says {expected[:12]}… and {f.size} bytes. Removed it; Try again downloads it anew.",
                       kind=ErrorKind.RETRYABLE)
    disk.blob_adopt(path, hashed.sha256)
    ModelFile.objects.filter(pk=item.row.pk).update(sha256=hashed.sha256, chunk_size=disk.CHUNK_SIZE,
                                                    chunk_hashes=hashed.chunk_hashes)


def _finish(model: StoredModel, folder: Path | None) -> None:
    """Link the tree, read the facts, and the model is Ready."""
    files = list(model.files.values_list("path", "sha256"))
    directory = disk.tree_link(model.repo, model.commit, files)
    found = facts.model_facts(directory)
    model_transition(model, to=ModelState.READY, facts=found, bytes_done=model.bytes_total, rate=0, ready_at=timezone.now())
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    model_changed(model)


def _failed(model: StoredModel, reason: str) -> None:
    # Only a download under way fails: a model that became Ready meanwhile (its job's worker died after the
    # last step, say) stays Ready.
    model_transition(model, to=ModelState.FAILED, reason=reason, only_from=[ModelState.DOWNLOADING], rate=0)
    model_changed(model)


def model_download_abandoned(job) -> None:
    """The reaper gave the download up (its worker died too often): the model says so."""
    _failed(StoredModel.objects.get(pk=job.target_id), job.error or "The download's worker stopped.")


# -- import: a directory on the server ------------------------------------------------------------


def model_import(*, directory: Path, repo: str, revision: str = "main", user=None) -> StoredModel:
    """A model from a directory on the server (a server without internet): the same checks as a download,
    but the digests are the files' own. Nothing is left behind when a check fails."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} holds no config.json: give the directory of a model "
                         "(a snapshot of its repository).")
    found = disk.local_files(directory)
    for path, _ in found:
        if problem := disk.path_problem(path):
            raise ValueError(problem)
    facts.model_facts(directory)  # well-formed before anything is copied (raises ValueError in words)
    size = sum(full.stat().st_size for _, full in found)
    if StoredModel.objects.filter(repo=repo, revision=revision).exists():
        raise ValueError(f"The store holds {repo} at {revision} already: delete it first, or import it as another revision.")
    if problem := disk.disk_space_problem(size):
        raise ValueError(problem)
    hashed = [(path, full, disk.hash_file(full)) for path, full in found]
    commit = disk.manifest_id([(path, h.sha256) for path, _, h in hashed])
    for _, full, h in hashed:
        disk.blob_adopt(full, h.sha256, keep_source=True)
    with transaction.atomic():
        model = StoredModel.objects.create(repo=repo, revision=revision, commit=commit, imported_from=str(directory),
                                           bytes_total=size, created_by=user if user and user.is_authenticated else None)
        ModelFile.objects.bulk_create([
            ModelFile(model=model, path=path, size=h.size, sha256=h.sha256, chunk_size=disk.CHUNK_SIZE,
                      chunk_hashes=h.chunk_hashes, hub_digest="") for path, _, h in hashed])
    _finish(model, None)
    model.refresh_from_db()
    return model
