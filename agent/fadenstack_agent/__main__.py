"""Command line entry point: ``python3 fadenstack-agent-<VERSION>.pyz COMMAND``.

Every command is declared in its own module with ``cli.command``; importing
the modules below declares them, in this order (the order ``known: ...``
lists them in).  Output is JSON lines (``protocol``; every command is listed
in ``docs/agent-protocol.md``); bad arguments give ``{"event": "error",
"kind": "bad_input"}`` and exit status 2, never a traceback.
"""

import sys

from . import facts, heartbeat, beat, machine, blob, image, blobserve, models, probe, runtime, ray, copies

# Importing a module declares its commands (``cli.command``).
COMMAND_MODULES = (facts, heartbeat, beat, machine, blob, image, blobserve, models, probe, runtime, ray, copies)
from .cli import dispatch
from .files import running_zip
from .protocol import RETRYABLE, AgentError, Emitter


def main(argv=None) -> int:
    """Run one command; returns the exit status (0 result, 1 error, 2 bad input).

    zipapp's generated ``__main__`` calls ``main()`` and drops the return value,
    so when called without ``argv`` from a zip this exits with the status itself.
    """
    out = Emitter()
    try:
        code = dispatch(sys.argv[1:] if argv is None else list(argv), out)
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
