"""How ``node files`` changes a machine's files, and how it puts them back.

Two kinds of file:

- files it owns whole (``/etc/fadenstack/hostfile``, the cluster's key, the sshd drop-in...):
  written aside, fsynced and renamed over (``files.atomic_write``); a file that was there
  before the first write is kept in the record and put back by ``node files remove``;
- files it shares with the machine (``/etc/hosts``, root's ``~/.ssh/config`` and
  ``authorized_keys``, ``sshd_config``): only a block between two marker lines is ours,
  replaced in place, the rest of the file untouched byte for byte.

Paths are the machine's (``/etc/hosts``): results and the record name them so.  ``Root.real``
puts them under ``FADEN_NODE_FILES_ROOT`` when it is set (tests run on a temporary
directory); on machines it is unset and a path is itself.
"""

import base64
import errno
import json
import os

from .files import atomic_write, fsync_dir, is_root, read_json

ENV_ROOT = "FADEN_NODE_FILES_ROOT"
RECORD = "/etc/fadenstack/node-files.json"


class Root:
    """Where the machine's ``/`` is for these commands: ``/`` itself, or a test's directory."""

    def __init__(self, top=None):
        self.top = os.path.abspath(top) if top else ""

    @classmethod
    def from_env(cls) -> "Root":
        return cls(os.environ.get(ENV_ROOT) or None)

    @property
    def overridden(self) -> bool:
        return bool(self.top)

    def real(self, path: str) -> str:
        return os.path.join(self.top, path.lstrip("/")) if self.top else path


# ------------------------------------------------------------------ whole files


def read(real: str):
    """``(bytes, mode, uid, gid)`` of a file, or ``(None, None, None, None)`` when there is none."""
    try:
        with open(real, "rb") as fh:
            st = os.fstat(fh.fileno())
            return fh.read(), st.st_mode & 0o7777, st.st_uid, st.st_gid
    except FileNotFoundError:
        return None, None, None, None


def put(real: str, data, mode: int) -> bool:
    """Make ``real`` hold ``data`` with ``mode`` (``data`` None: no file); whether anything changed.

    An existing file keeps its owner.  A file that cannot be renamed over (``/etc/hosts`` is a
    bind mount in containers and in the lab: EBUSY) is rewritten in place instead."""
    current, current_mode, uid, gid = read(real)
    if data is None:
        if current is None:
            return False
        os.unlink(real)
        fsync_dir(os.path.dirname(real))
        return True
    if current == data and current_mode == mode:
        return False
    try:
        atomic_write(real, data, mode)
    except OSError as exc:
        if current is None or exc.errno not in (errno.EBUSY, errno.EXDEV):
            raise
        _rewrite_in_place(real, data, mode)
    if uid is not None and is_root() and (uid, gid) != (0, 0):
        os.chown(real, uid, gid)
    return True


def _rewrite_in_place(real: str, data: bytes, mode: int) -> None:
    with open(real, "r+b") as fh:
        fh.truncate(0)
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
        os.fchmod(fh.fileno(), mode)


def ensure_dir(root: Root, path: str, mode: int, created: list) -> None:
    """Make the directory ``path`` and its missing parents with ``mode``; each one made is added
    to ``created`` (machine paths, parents first) so that ``remove`` can take it away again."""
    missing = []
    probe = path
    while not os.path.isdir(root.real(probe)):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for directory in reversed(missing):
        os.mkdir(root.real(directory), mode)
        os.chmod(root.real(directory), mode)  # mkdir's mode passes through the umask
        created.append(directory)


def remove_dirs(root: Root, directories: list) -> list:
    """Remove the directories ``ensure_dir`` made, deepest first, those still empty; the removed."""
    removed = []
    for directory in sorted(set(directories), key=len, reverse=True):
        try:
            os.rmdir(root.real(directory))
            removed.append(directory)
        except OSError:
            pass  # not empty (someone else's files) or already gone: it stays
    return removed


# ------------------------------------------------------------------ marked blocks


def _line(line: str) -> str:
    return line.rstrip("\r\n")


def _spans(lines: list, begin: str, end: str) -> list:
    """``(first, last)`` line indices of each block: a begin marker and the next end marker with no
    other begin between (a stray begin line, from a hand edit, is left as a line of the file)."""
    spans, start = [], None
    for i, line in enumerate(lines):
        text = _line(line)
        if text == begin:
            start = i
        elif text == end and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _without(lines: list, spans: list) -> list:
    drop = {i for first, last in spans for i in range(first, last + 1)}
    return [line for i, line in enumerate(lines) if i not in drop]


def block_text(begin: str, end: str, body: str) -> str:
    return begin + "\n" + body + end + "\n"


def block_put(text: str, begin: str, end: str, body: str, top: bool = False):
    """``text`` with our block holding ``body``: in place of the first block there (any others go),
    else at the top or the end.  Returns ``(text, newline_added)``: whether a newline had to be
    added to a last line that had none (``block_drop`` takes it away again)."""
    block = block_text(begin, end, body)
    lines = text.splitlines(keepends=True)
    spans = _spans(lines, begin, end)
    if spans:
        kept = _without(lines, spans)
        first = spans[0][0]
        return "".join(kept[:first] + [block] + kept[first:]), False
    if top:
        return block + text, False
    if text and not text.endswith("\n"):
        return text + "\n" + block, True
    return text + block, False


def block_drop(text: str, begin: str, end: str, newline_added: bool = False) -> str:
    """``text`` without our blocks, as it was before ``block_put``."""
    lines = text.splitlines(keepends=True)
    spans = _spans(lines, begin, end)
    if not spans:
        return text
    at_end = spans[-1][1] == len(lines) - 1
    rest = "".join(_without(lines, spans))
    if newline_added and at_end and rest.endswith("\n"):
        rest = rest[:-1]
    return rest


def block_body(text: str, begin: str, end: str):
    """The lines between our markers (the first block), or None when the text has none."""
    lines = text.splitlines(keepends=True)
    spans = _spans(lines, begin, end)
    if not spans:
        return None
    first, last = spans[0]
    return "".join(lines[first + 1:last])


def decode(data) -> str:
    # surrogateescape: a file with bytes that are not UTF-8 comes back byte for byte.
    return "" if data is None else data.decode("utf-8", "surrogateescape")


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


# ------------------------------------------------------------------ the record


class Record:
    """What the first ``node files write`` found, so that ``remove`` undoes exactly what it did:
    for each whole file, its content and mode before (or that there was none); for each shared
    file, whether it was made for the block and whether a newline was added; the directories made;
    the sshd configuration and authorized keys file it edited.  0600: an original may be a key."""

    def __init__(self, root: Root):
        self.root = root
        data = read_json(root.real(RECORD)) or {}
        self.files = dict(data.get("files") or {})
        self.blocks = dict(data.get("blocks") or {})
        self.dirs = list(data.get("dirs") or [])
        self.paths = dict(data.get("paths") or {})
        self.cluster = data.get("cluster")  # the cluster the node settings were last written for
        self.exists = bool(data)

    def keep_original(self, path: str) -> None:
        """Before ``path`` is first written: what it held."""
        if path in self.files:
            return
        data, mode, _, _ = read(self.root.real(path))
        self.files[path] = None if data is None else {"data": base64.b64encode(data).decode("ascii"), "mode": mode}

    def original(self, path: str):
        """``(bytes, mode)`` the file held before the first write, or None (there was no file)."""
        entry = self.files.get(path)
        if not entry:
            return None
        return base64.b64decode(entry["data"]), int(entry["mode"])

    def note_block(self, path: str, created: bool, newline_added: bool) -> None:
        if path not in self.blocks:
            self.blocks[path] = {"created": created, "newline_added": newline_added}

    def block(self, path: str) -> dict:
        return self.blocks.get(path) or {"created": False, "newline_added": False}

    def save(self) -> None:
        data = {"files": self.files, "blocks": self.blocks, "dirs": self.dirs, "paths": self.paths, "cluster": self.cluster}
        put(self.root.real(RECORD), (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"), 0o600)

    def forget(self) -> None:
        put(self.root.real(RECORD), None, 0o600)
