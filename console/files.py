"""Files the console writes so that they appear whole: the temporary name each writer uses beside them."""
import os
import threading
from pathlib import Path


def writer_temporary(path: Path) -> Path:
    """A hidden name beside ``path`` that is this writer's own (process and thread): writers in several
    worker processes at once never rename or truncate each other's half-written file."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
