"""Files the console writes so that they appear whole: the temporary name each writer uses beside them,
and files made once (keys) that no second writer replaces."""
import os
import threading
from pathlib import Path


def writer_temporary(path: Path) -> Path:
    """A hidden name beside ``path`` that is this writer's own (process and thread): writers in several
    worker processes at once never rename or truncate each other's half-written file."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def write_once(path: Path, content: bytes, *, mode: int = 0o600) -> bool:
    """Put ``content`` at ``path`` unless a file is there: written aside with ``mode``, flushed to disk,
    then linked in place, so that it appears whole and never over what another writer put there first.
    True when this writer's content went in; False when another's was there (read that one)."""
    temporary = writer_temporary(path)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(content)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
        return True
    finally:
        temporary.unlink(missing_ok=True)
