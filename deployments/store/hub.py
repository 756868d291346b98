"""The Hugging Face Hub as the server speaks to it, through ``huggingface_hub``: what a revision's
files are (with the digests the hub gives: LFS sha256, git blob ids) and downloading one file.

The endpoint is ``settings.FADEN_HF_ENDPOINT`` (``HF_ENDPOINT`` by default, so a mirror works; the
lab points it at its stand-in hub). The token is handed to ``huggingface_hub`` in this process only:
never on a command line, in a task's arguments, a log line or an error message. Every failure comes
out as ``HubError`` with a sentence of ours, never the library's text with a header in it.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from console.choices import ErrorKind

log = logging.getLogger(__name__)

# org/name as the hub allows them: letters, digits, - _ . (no leading/trailing -. or "--", "..").
REPO_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")
TIMEOUT = 30  # seconds for the hub to answer a request (a download's bytes may take longer)


class HubError(Exception):
    """A refusal or a failure of the hub, in words, with a job error kind."""

    def __init__(self, message: str, *, kind: str = ErrorKind.RETRYABLE):
        super().__init__(message)
        self.message = message
        self.kind = kind


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str  # the LFS sha256, empty for a file kept in git
    blob_id: str  # the git blob id (sha1), what the hub gives for every file


@dataclass(frozen=True)
class HubListing:
    repo: str
    revision: str
    commit: str
    gated: bool
    files: tuple[HubFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def endpoint() -> str:
    return settings.FADEN_HF_ENDPOINT


def repo_problem(repo: str) -> str | None:
    """Why ``repo`` is not a repository id the hub could have, in words; None when it could."""
    if not repo:
        return "Give the model's repository id on the hub, like Qwen/Qwen2.5-0.5B-Instruct."
    if not REPO_RE.match(repo) or "--" in repo or ".." in repo or repo.endswith((".", "-")):
        return (f"{repo[:100]!r} is not a repository id: use org/name with letters, digits, '-', '_' and '.', "
                "like Qwen/Qwen2.5-0.5B-Instruct.")
    return None


def revision_problem(revision: str) -> str | None:
    if not REVISION_RE.match(revision or "") or ".." in revision:
        return f"{(revision or '')[:100]!r} is not a revision: give a branch, a tag or a commit id (main by default)."
    return None


def listing(repo: str, revision: str, *, token: str | None) -> HubListing:
    """The revision's commit and files, with sizes and digests, as the hub tells them."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint(), token=token or False).model_info(
            repo, revision=revision, files_metadata=True, timeout=TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one sentence of ours
        raise _hub_error(exc, repo=repo, revision=revision, token=token) from None
    files = []
    for sibling in info.siblings or ():
        lfs = sibling.lfs
        size = lfs.size if lfs else sibling.size
        if size is None:
            raise HubError(f"The hub did not say how big {repo}'s {sibling.rfilename} is.", kind=ErrorKind.NOT_RETRYABLE)
        files.append(HubFile(path=sibling.rfilename, size=int(size), sha256=(lfs.sha256 if lfs else "") or "",
                             blob_id=sibling.blob_id or ""))
    if not files:
        raise HubError(f"{repo} at {revision} has no files on the hub.", kind=ErrorKind.NOT_RETRYABLE)
    return HubListing(repo=repo, revision=revision, commit=info.sha or "", gated=bool(info.gated), files=tuple(files))


def download(listing: HubListing, file: HubFile, *, into: Path, token: str | None) -> Path:
    """One file of the revision into ``into``, as ``<digest>.part`` until whole, then ``<digest>``.

    A ``.part`` left by an earlier try (a dropped link, a worker that died) is resumed with a ``Range``
    request; huggingface_hub gives the file's URL, the headers (the token among them) and the hub's
    errors, and its HTTP client drops the token on a redirect to another host (the hub's CDN)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    name = file.sha256 or file.blob_id
    target, part = into / name, into / f"{name}.part"
    if target.is_file() and target.stat().st_size == file.size:
        return target
    url = hf_hub_url(listing.repo, file.path, revision=listing.commit or listing.revision, endpoint=endpoint())
    headers = build_hf_headers(token=token or False)
    have = part.stat().st_size if part.is_file() else 0
    if 0 < have < file.size:
        headers["Range"] = f"bytes={have}-"
    elif have:
        part.unlink()
        have = 0
    try:
        with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=TIMEOUT) as response:
            hf_raise_for_status(response)
            resumed = response.status_code == 206 and response.headers.get("Content-Range", "").startswith(f"bytes {have}-")
            with part.open("ab" if resumed else "wb") as out:
                for piece in response.iter_bytes(1 << 20):
                    out.write(piece)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one sentence of ours; the .part stays
        raise _hub_error(exc, repo=listing.repo, revision=listing.revision, token=token, path=file.path) from None
    part.replace(target)
    return target


def _hub_error(exc: Exception, *, repo: str, revision: str, token: str | None, path: str = "") -> HubError:
    """The hub's refusal in words; a token never appears in what comes out (it is not read from ``exc``)."""
    from huggingface_hub import errors

    status = getattr(getattr(exc, "response", None), "status_code", None)
    where = endpoint()
    if isinstance(exc, errors.GatedRepoError) or (status in (401, 403) and isinstance(exc, errors.HfHubHTTPError)):
        if not token:
            return HubError(f"{repo} is a gated model: the hub asks for a token. Set the server's Hugging Face token "
                            "(Settings) with access to it, then Try again.", kind=ErrorKind.NOT_RETRYABLE)
        if status == 401:
            return HubError(f"The hub refused the server's Hugging Face token for {repo}: it is not valid. "
                            "Replace it in Settings, then Try again.", kind=ErrorKind.NOT_RETRYABLE)
        return HubError(f"The server's Hugging Face token has no access to {repo}: request access on the model's "
                        "page on the hub (or set a token that has it), then Try again.", kind=ErrorKind.NOT_RETRYABLE)
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{repo} has no revision {revision!r} on the hub at {where}.", kind=ErrorKind.NOT_RETRYABLE)
    if isinstance(exc, errors.EntryNotFoundError):
        return HubError(f"{repo} at {revision} has no file {path!r} on the hub any more.", kind=ErrorKind.NOT_RETRYABLE)
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubError(f"There is no model {repo} on the hub at {where} (or it is private and the token cannot "
                        "see it).", kind=ErrorKind.NOT_RETRYABLE)
    cause = _cause(exc)
    if isinstance(exc, errors.HfHubHTTPError) and status:
        return HubError(f"The hub at {where} answered {status} for {repo}{f' {path}' if path else ''}; try again later.")
    log.info("hub request for %s failed: %s", repo, type(exc).__name__)
    return HubError(f"Could not reach the hub at {where}: {cause}.", kind=ErrorKind.UNREACHABLE)


def _cause(exc: BaseException) -> str:
    """The root cause's kind in words (connection refused, timed out...), without any request's headers."""
    seen = exc
    while seen.__cause__ is not None or seen.__context__ is not None:
        seen = seen.__cause__ or seen.__context__
    text = str(seen).lower()
    for needle, words in (("refused", "connection refused"), ("no route", "no route to host"),
                          ("timed out", "the connection timed out"), ("timeout", "the connection timed out"),
                          ("name or service", "the name does not resolve"), ("unreachable", "the network is unreachable"),
                          ("reset", "the connection was reset")):
        if needle in text:
            return words
    return type(seen).__name__
