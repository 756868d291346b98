"""The agent's side of the wire: JSON objects, one per line, on stdout.

Every command prints any number of ``{"event": "progress", ...}`` and
``{"event": "log", "message": ...}`` lines and ends with exactly one
``{"event": "result", ...}`` (exit 0) or
``{"event": "error", "kind": K, "message": M}`` (exit 1; exit 2 for
``bad_input``), K one of ``ERROR_KINDS``.  Progress of a transfer names the
file: ``{"event": "progress", "digest", "bytes", "total", ...}``.

Every command, its flags, its stdin and its result keys are listed in
``docs/agent-protocol.md`` (a test holds that list to the declared commands).
"""

import json
import sys
import time

RETRYABLE = "retryable"            # try again later: the same call may well succeed
NOT_RETRYABLE = "not_retryable"    # the same cause would come out of every retry
ADDRESS_IN_USE = "address_in_use"  # a port the command must listen on is held by another process
NO_ROOM = "no_room"                # the store has not the room the file needs
UNREACHABLE = "unreachable"        # another machine (a source, the Ray head, a probe) does not answer
BAD_INPUT = "bad_input"            # the command line or stdin is wrong (exit status 2)

# Every kind an error line may carry: the server holds its own list to this one.
ERROR_KINDS = (RETRYABLE, NOT_RETRYABLE, ADDRESS_IN_USE, NO_ROOM, UNREACHABLE, BAD_INPUT)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2


class AgentError(Exception):
    """A failure the agent reports as an ``error`` line with a kind."""

    def __init__(self, kind: str, message: str):
        if kind not in ERROR_KINDS:
            raise ValueError("unknown error kind %r" % (kind,))
        super().__init__(message)
        self.kind = kind
        self.message = message

    @property
    def exit_code(self) -> int:
        return EXIT_BAD_INPUT if self.kind == BAD_INPUT else EXIT_ERROR


class Emitter:
    """Writes protocol lines to a text stream, flushing after each line.

    A closed pipe on the reading side (the SSH session went away) must not
    turn into a traceback, so write errors are swallowed after the first.
    """

    def __init__(self, stream=None):
        self._stream = stream
        self._broken = False
        self.finished = False

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stdout

    def emit(self, event: str, **fields) -> None:
        obj = {"event": event}
        obj.update(fields)
        line = json.dumps(obj, ensure_ascii=True, separators=(",", ":"), default=str)
        if self._broken:
            return
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (BrokenPipeError, OSError, ValueError):
            self._broken = True

    def progress(self, **fields) -> None:
        self.emit("progress", **fields)

    def log(self, message: str, **fields) -> None:
        fields.setdefault("time", round(time.time(), 3))
        self.emit("log", message=message, **fields)

    def result(self, **fields) -> int:
        self.finished = True
        self.emit("result", **fields)
        return EXIT_OK

    def error(self, kind: str, message: str) -> int:
        if kind not in ERROR_KINDS:
            kind = RETRYABLE
        self.finished = True
        self.emit("error", kind=kind, message=message)
        return EXIT_BAD_INPUT if kind == BAD_INPUT else EXIT_ERROR
