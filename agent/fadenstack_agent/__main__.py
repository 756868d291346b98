"""Command line entry point: ``python3 fadenstack-agent-<VERSION>.pyz COMMAND``.

Commands: ``version``, ``facts [--store PATH]``,
``heartbeat start --url URL [--interval S]`` (token on stdin),
``heartbeat run|stop|status``, ``uninstall``.  Output is JSON lines
(``protocol``); bad arguments give ``{"event": "error", "kind": "bad_input"}``
and exit status 2, never a traceback.
"""

import argparse
import re
import sys

from .protocol import BAD_INPUT, RETRYABLE, AgentError, Emitter

COMMANDS = ("version", "facts", "heartbeat", "uninstall", "image", "probe", "runtime", "ray")
HEARTBEAT_COMMANDS = ("start", "run", "stop", "status")


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``AgentError(bad_input)`` instead of exiting."""

    def error(self, message):
        m = re.search(r"invalid choice: '?([^' ]*)'? \(choose from (.*)\)", message)
        if m:
            choices = ", ".join(c.strip(" '") for c in m.group(2).split(","))
            message = "unknown command %r (known: %s)" % (m.group(1), choices)
        raise AgentError(BAD_INPUT, "%s: %s" % (self.prog, message))


def build_parser() -> argparse.ArgumentParser:
    from .heartbeat import parse_interval

    parser = _Parser(prog="fadenstack-agent", allow_abbrev=False,
                     description="Fadenstack machine agent (JSON lines on stdout).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("version", help="print the agent version", allow_abbrev=False)
    facts = sub.add_parser("facts", help="describe this machine", allow_abbrev=False)
    facts.add_argument("--store", metavar="PATH", help="store directory to measure")
    hb = sub.add_parser("heartbeat", help="the heartbeat daemon", allow_abbrev=False)
    hb_sub = hb.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    start = hb_sub.add_parser("start", allow_abbrev=False,
                              help="configure and start the daemon (token on stdin)")
    start.add_argument("--url", required=True, help="console heartbeat URL")
    start.add_argument("--interval", type=parse_interval, default=10, metavar="SECONDS",
                       help="seconds between beats (default 10)")
    hb_sub.add_parser("run", help="run the heartbeat loop in the foreground", allow_abbrev=False)
    hb_sub.add_parser("stop", help="stop the daemon", allow_abbrev=False)
    hb_sub.add_parser("status", help="report the daemon's state", allow_abbrev=False)
    sub.add_parser("uninstall", help="remove the agent (keeps the store)", allow_abbrev=False)
    from . import image, probe  # image fetch|verify|load|list|serve, probe serve|send
    image.add_commands(sub, _Parser)
    probe.add_commands(sub, _Parser)
    from . import ray, runtime  # runtime start|stop|status, ray start-head|join|status|stop
    runtime.add_commands(sub, _Parser)
    ray.add_commands(sub, _Parser)
    return parser


def _handler(args):
    from . import beat, commands, heartbeat

    if args.command is None:
        raise AgentError(BAD_INPUT, "no command given (known: %s)" % ", ".join(COMMANDS))
    if getattr(args, "handler", None) is not None:   # commands that name their own handler
        return args.handler
    if args.command == "heartbeat":
        if args.action is None:
            raise AgentError(BAD_INPUT, "heartbeat needs an action (known: %s)"
                             % ", ".join(HEARTBEAT_COMMANDS))
        return {"start": heartbeat.cmd_start, "run": beat.cmd_run,
                "stop": heartbeat.cmd_stop, "status": heartbeat.cmd_status}[args.action]
    return {"version": commands.cmd_version, "facts": commands.cmd_facts,
            "uninstall": commands.cmd_uninstall}[args.command]


def main(argv=None) -> int:
    """Run one command; returns the exit status (0 result, 1 error, 2 bad input).

    zipapp's generated ``__main__`` calls ``main()`` and drops the return value,
    so when called without ``argv`` from a zip this exits with the status itself.
    """
    out = Emitter()
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        code = _handler(args)(args, out)
    except AgentError as exc:
        code = out.error(exc.kind, exc.message)
    except KeyboardInterrupt:
        code = out.error(RETRYABLE, "interrupted")
    except Exception as exc:  # noqa: BLE001 - the protocol wants every failure as a line
        code = out.error(RETRYABLE, "%s: %s" % (type(exc).__name__, exc))
    if argv is None:
        from .paths import running_zip

        if running_zip():
            sys.exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
