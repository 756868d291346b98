"""The one way agent commands are declared, and the command line built from them.

Every module that has commands declares them where they are written::

    group("image", help="the runtime image store")

    @command("image", "load", args=[STORE, DIGEST])
    def cmd_load(args, out):
        '''``image load --digest D``: ...'''

A handler takes the parsed arguments and the ``protocol.Emitter`` and returns
the exit status (``out.result(...)`` returns it).  ``__main__`` imports the
modules (their decorators fill ``COMMANDS``) and runs ``dispatch``.  The same
handler may be declared under two names (``image serve start`` and ``blob
serve start``): decorators stack.
"""

import argparse
import re

from .protocol import BAD_INPUT, AgentError

COMMANDS = {}        # ("image", "fetch") -> Command, in the order declared
GROUPS = {}          # ("image",) -> help text


class Command:
    def __init__(self, path: tuple, handler, args: list):
        self.path, self.handler, self.args = path, handler, list(args)
        doc = (handler.__doc__ or "").strip()
        if not doc:
            raise ValueError("agent command %r has no docstring" % " ".join(path))
        self.doc = doc

    @property
    def name(self) -> str:
        return " ".join(self.path)

    @property
    def help(self) -> str:
        """The docstring's first sentence without the ``usage``: what it does."""
        first = " ".join(self.doc.split("\n\n", 1)[0].split())
        return first.split("``: ", 1)[-1].split(". ", 1)[0].rstrip(".")


def arg(*flags, **options) -> tuple:
    """One argument, as for ``ArgumentParser.add_argument``."""
    return flags, options


def group(*path, help: str) -> None:
    """Name a command group (``image``, ``image serve``) and say what it is for."""
    GROUPS[tuple(path)] = help


def command(*path, args=()):
    """Declare the agent command ``path`` (``"image", "fetch"``) with ``args``."""
    def register(handler):
        key = tuple(path)
        if key in COMMANDS:
            raise ValueError("agent command %r declared twice" % " ".join(key))
        COMMANDS[key] = Command(key, handler, args)
        return handler
    return register


# ------------------------------------------------------------------ argument types


def port_arg(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0: any free port)."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError("must be a TCP port from 0 to 65535, got %r" % text)
    return int(text)


def seconds_arg(low: float, high: float):
    """argparse type: a number of seconds from ``low`` to ``high``."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (low <= value <= high):
            raise argparse.ArgumentTypeError("must be a number of seconds from %g to %g, got %r"
                                             % (low, high, text))
        return value
    return parse


STORE = arg("--store", metavar="PATH", help="store directory (default: the machine's)")
DIGEST = arg("--digest", required=True, metavar="SHA256", help="the file's sha256")


# ------------------------------------------------------------------ the parser


class Parser(argparse.ArgumentParser):
    """argparse that raises ``AgentError(bad_input)`` instead of exiting."""

    def error(self, message):
        m = re.search(r"invalid choice: '?([^' ]*)'? \(choose from (.*)\)", message)
        if m:
            choices = ", ".join(c.strip(" '") for c in m.group(2).split(","))
            message = "unknown command %r (known: %s)" % (m.group(1), choices)
        raise AgentError(BAD_INPUT, "%s: %s" % (self.prog, message))


def _level(depth: int) -> str:
    return "_command_%d" % depth


def build_parser() -> argparse.ArgumentParser:
    """The command line of every declared command.

    Only the commands set ``handler`` (a group's default would be kept over
    its command's by some Python 3.9 releases); a group given alone is told
    apart in ``dispatch`` from the names each level stored."""
    top = Parser(prog="fadenstack-agent", allow_abbrev=False,
                 description="Fadenstack machine agent (JSON lines on stdout).")
    actions = {(): top.add_subparsers(dest=_level(0), metavar="COMMAND", parser_class=Parser)}
    for path, cmd in COMMANDS.items():
        for depth in range(1, len(path)):
            prefix = path[:depth]
            if prefix not in actions:
                parser = actions[prefix[:-1]].add_parser(prefix[-1], help=GROUPS.get(prefix, ""),
                                                         allow_abbrev=False)
                actions[prefix] = parser.add_subparsers(dest=_level(depth), metavar="ACTION",
                                                        parser_class=Parser)
        parser = actions[path[:-1]].add_parser(path[-1], help=cmd.help, allow_abbrev=False)
        for flags, options in cmd.args:
            parser.add_argument(*flags, **options)
        parser.set_defaults(handler=cmd.handler)
    return top


def known(prefix: tuple) -> list:
    """The names that may follow ``prefix`` on the command line, in declared order."""
    names = []
    for path in COMMANDS:
        if len(path) > len(prefix) and path[:len(prefix)] == prefix and path[len(prefix)] not in names:
            names.append(path[len(prefix)])
    return names


def handler_for(args):
    """The handler of the parsed command line, or ``bad_input`` for a group alone."""
    handler = getattr(args, "handler", None)
    if handler is not None:
        return handler
    given = []
    while getattr(args, _level(len(given)), None):
        given.append(getattr(args, _level(len(given))))
    if not given:
        raise AgentError(BAD_INPUT, "no command given (known: %s)" % ", ".join(known(())))
    raise AgentError(BAD_INPUT, "%s needs an action (known: %s)"
                     % (" ".join(given), ", ".join(known(tuple(given)))))


def dispatch(argv: list, out) -> int:
    """Parse ``argv`` and run its command; AgentError propagates to the caller."""
    args = build_parser().parse_args(argv)
    return handler_for(args)(args, out)
