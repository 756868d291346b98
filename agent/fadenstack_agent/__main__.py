"""Command line entry point: ``python3 fadenstack-agent-<VERSION>.pyz COMMAND``.

Every command is declared in its own module with ``cli.command``; importing
the modules below declares them, in this order (the order ``known: ...``
lists them in).  Output is JSON lines (``protocol``; every command is listed
in ``docs/agent-protocol.md``); bad arguments give ``{"event": "error",
"kind": "bad_input"}`` and exit status 2, never a traceback.
"""

import importlib
import sys

from .cli import dispatch
from .files import running_zip
from .protocol import RETRYABLE, AgentError, Emitter

# Importing a module declares its commands (``cli.command``), in this order.
COMMAND_MODULE_NAMES = ("facts", "heartbeat", "beat", "machine", "blob", "image", "blobserve", "models", "probe",
                        "runtime", "ray", "raydrain", "copies", "nodefiles", "shared", "allreduce",
                        "clustersecrets",
                        "firewall",
                        "tls")
# A command's first word -> the modules that declare commands under it. Only those are imported: a
# command is run over SSH for every look at a machine, and importing all of them (HTTP, TLS, threads
# and their standard modules) costs more CPU than most commands do. Any other word loads them all
# (for `known: ...`); tests/agent/test_protocol.py holds this table to the declarations.
MODULES_OF = {
    "facts": ("facts",), "heartbeat": ("heartbeat", "beat"), "version": ("machine",), "uninstall": ("machine",),
    "blob": ("blob", "blobserve"), "image": ("image", "blobserve"), "model": ("models",), "hub": ("models",),
    "probe": ("probe",), "runtime": ("runtime",), "ray": ("ray", "raydrain"), "copy": ("copies",), "node": ("nodefiles",),
    "shared": ("shared",), "allreduce": ("allreduce",),
    "cluster": ("clustersecrets",),
    "firewall": ("firewall",),
    "tls": ("tls",),
}


def load_commands(names=COMMAND_MODULE_NAMES) -> list:
    """Import the named command modules (declaring their commands); returns the modules."""
    return [importlib.import_module("." + name, __package__) for name in COMMAND_MODULE_NAMES if name in names]


def _modules_for(argv: list) -> tuple:
    first = next((word for word in argv if not word.startswith("-")), None)
    return MODULES_OF.get(first, COMMAND_MODULE_NAMES)


def main(argv=None) -> int:
    """Run one command; returns the exit status (0 result, 1 error, 2 bad input).

    zipapp's generated ``__main__`` calls ``main()`` and drops the return value,
    so when called without ``argv`` from a zip this exits with the status itself.
    """
    out = Emitter()
    argv_given = sys.argv[1:] if argv is None else list(argv)
    try:
        load_commands(_modules_for(argv_given))
        code = dispatch(argv_given, out)
    except AgentError as exc:
        code = out.error(exc.kind, exc.message)
    except KeyboardInterrupt:
        code = out.error(RETRYABLE, "interrupted")
    except Exception as exc:  # noqa: BLE001 - the protocol wants every failure as a line
        code = out.error(RETRYABLE, "%s: %s" % (type(exc).__name__, exc))
    if argv is None and running_zip():
        sys.exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
