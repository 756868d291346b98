"""The data directory is the console's alone: its keys, its SQLite file (API tokens, sessions), its builds.

The settings call ``private`` at every start, whatever existed before: a directory
made by hand, by an older version or restored from a backup keeps its mode
otherwise, and ``mkdir(mode=...)`` changes nothing of a directory that is there.
Group and other lose every permission on the directory and everything in it, and
on the secrets kept elsewhere (``FADEN_SSH_KEY``, a SQLite file named by
``DATABASE_URL``). Symbolic links are left alone: chmod would change their target.
"""
from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable
from pathlib import Path

OTHERS = 0o077  # the group's and everyone else's bits


def private(data_dir: Path, *, secrets_elsewhere: Iterable[Path] = (), database: dict | None = None) -> None:
    """Make the data directory and all it holds, each of ``secrets_elsewhere`` that exists, and the
    ``database``'s file when it is SQLite, private to this user."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    sqlite = _sqlite_files(database or {})
    if sqlite:
        _private_file_create(sqlite[0])
    for root, _dirs, files in os.walk(data_dir):
        _restrict(Path(root))
        for name in files:
            _restrict(Path(root) / name)
    for path in [*secrets_elsewhere, *sqlite]:
        _restrict(path)


def _sqlite_files(database: dict) -> list[Path]:
    """A SQLite database's file and its -wal and -shm files; none for another engine or a database in memory."""
    name = str(database.get("NAME") or "")
    if not database.get("ENGINE", "").endswith("sqlite3") or name in ("", ":memory:") or name.startswith("file:"):
        return []
    path = Path(name)
    return [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]


def _private_file_create(path: Path) -> None:
    """Create ``path`` empty with mode 0600 unless it is there: SQLite, which opens it next, accepts an empty
    file as a new database and gives its -wal and -shm files the same mode."""
    if not path.parent.is_dir():
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass


def _restrict(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode) or not stat.S_IMODE(mode) & OTHERS:
        return
    try:
        path.chmod(stat.S_IMODE(mode) & ~OTHERS)
    except OSError as error:  # another user's file: say so at start, where the operator looks
        print(f"fadenstack: could not make {path} private to this user: {error}", file=sys.stderr)
