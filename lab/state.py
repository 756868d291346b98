"""The lab's state directory: what `up` made, so `down` and faults can find it.

``state.json`` lists every resource the moment it is made (and only what this
lab made: a failed `up` must never remove another lab's bridge), plus each
machine's power, init pid and active faults. Writes are atomic (rename);
commands that change the lab hold an flock on ``.lock``.

The host can hold only one lab (namespace and bridge names are fixed) while
FADEN_LAB_DIR may differ between callers (the test suite uses temporary
ones, possibly several sessions at once). So `up` and `down` also hold a
host-wide flock, and a small marker, ``/run/fadenstack-lab.json``, names the
state dir of the lab that is up.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from . import DEFAULT_STATE_DIR

MARKER = Path("/run/fadenstack-lab.json")
HOST_LOCK = Path("/run/fadenstack-lab.lock")


def state_dir_from_env() -> Path:
    return Path(os.environ.get("FADEN_LAB_DIR") or DEFAULT_STATE_DIR).absolute()


class LabState:
    """The state directory of one lab."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.file = self.root / "state.json"
        self.data: dict = {}

    def machine_dir(self, name: str) -> Path:
        return self.root / "machines" / name

    def exists(self) -> bool:
        return self.file.exists()

    def load(self) -> dict:
        try:
            self.data = json.loads(self.file.read_text())
        except FileNotFoundError:
            self.data = {}
        return self.data

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        temporary = self.file.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        os.replace(temporary, self.file)

    def record(self, kind: str, item) -> None:
        """Note a resource about to be created, and save at once."""
        created = self.data.setdefault("created", {})
        items = created.setdefault(kind, [])
        if item not in items:
            items.append(item)
        self.save()

    def created(self, kind: str) -> list:
        return list(self.data.get("created", {}).get(kind, []))

    def machine(self, name: str) -> dict:
        return self.data.setdefault("machines", {}).setdefault(name, {})

    @contextlib.contextmanager
    def locked(self, create: bool = False):
        """Hold the lab's lock while changing it (one `up`/`down`/fault at a time).

        Without create, a missing state dir is simply an empty state: `down`
        or a fault on a lab that was never up leaves no directory behind.
        """
        if not self.root.is_dir():
            if not create:
                self.data = {}
                yield self
                return
            self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                self.load()
                yield self
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def read_marker() -> dict | None:
    try:
        return json.loads(MARKER.read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_marker(state_dir: Path) -> None:
    MARKER.write_text(json.dumps({"state_dir": str(state_dir), "pid": os.getpid()}) + "\n")


def remove_marker(state_dir: Path) -> None:
    marker = read_marker()
    if marker is None or marker.get("state_dir") == str(state_dir):
        with contextlib.suppress(FileNotFoundError):
            MARKER.unlink()


@contextlib.contextmanager
def host_locked():
    """One `up` or `down` at a time on this host, whatever their state dirs."""
    with open(HOST_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
