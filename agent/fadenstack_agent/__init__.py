"""Fadenstack agent: the program that runs on each enrolled GPU machine.

Standard library only (Python 3.9+).  The console ships this package as a
versioned zipapp and runs ``python3 fadenstack-agent-<VERSION>.pyz COMMAND``
over SSH; every command speaks JSON lines on stdout (see ``protocol``).
"""

import pkgutil

_VERSION = None


def get_version() -> str:
    """Return the agent version from the ``VERSION`` data file.

    ``pkgutil.get_data`` reads it from the source tree and from inside the
    zipapp alike.
    """
    global _VERSION
    if _VERSION is None:
        data = pkgutil.get_data("fadenstack_agent", "VERSION")
        _VERSION = (data or b"").decode("ascii", "replace").strip() or "0+unknown"
    return _VERSION
