"""The agent's contract with the console: the error kinds, the list of commands
in docs/agent-protocol.md, the command lines the console sends, and a package
without import cycles."""

import ast
import itertools
import os
import re

import pytest

from fadenstack_agent import cli, protocol
from fadenstack_agent.__main__ import COMMAND_MODULE_NAMES, MODULES_OF, load_commands

COMMAND_MODULES = load_commands()

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PACKAGE_DIR = os.path.join(REPO, "agent", "fadenstack_agent")
PROTOCOL_DOC = os.path.join(REPO, "docs", "agent-protocol.md")
DIGEST = "ab" * 32


def test_the_error_kinds_are_one_tuple_the_server_can_hold_its_list_to():
    assert protocol.ERROR_KINDS == ("retryable", "not_retryable", "address_in_use", "no_room", "unreachable",
                                    "bad_input")
    with pytest.raises(ValueError):
        protocol.AgentError("something_else", "no such kind")


def _doc_sections() -> dict:
    with open(PROTOCOL_DOC) as fh:
        text = fh.read()
    parts = re.split(r"^### `([^`]+)`$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_protocol_document_lists_every_command_with_its_flags():
    sections = _doc_sections()
    declared = {cmd.name: cmd for cmd in cli.COMMANDS.values()}
    assert sorted(sections) == sorted(declared), "docs/agent-protocol.md and the declared commands differ"
    for name, cmd in declared.items():
        for flags, _ in cmd.args:
            assert flags[0] in sections[name], "docs/agent-protocol.md: `%s` does not mention %s" % (name, flags[0])


def test_the_entry_point_imports_exactly_the_modules_that_declare_commands():
    declaring = {cmd.handler.__module__ for cmd in cli.COMMANDS.values()}
    assert declaring == {module.__name__ for module in COMMAND_MODULES}


def test_each_first_word_loads_exactly_the_modules_that_declare_commands_under_it():
    declaring: dict = {}
    for cmd in cli.COMMANDS.values():
        declaring.setdefault(cmd.path[0], set()).add(cmd.handler.__module__.rsplit(".", 1)[1])
    assert {word: set(names) for word, names in MODULES_OF.items()} == declaring
    assert set(itertools.chain(*MODULES_OF.values())) == set(COMMAND_MODULE_NAMES)


def test_every_command_has_a_docstring_and_a_single_declaration():
    handlers = {}
    for cmd in cli.COMMANDS.values():
        assert cmd.doc
        handlers.setdefault(cmd.handler, []).append(cmd.name)
    # Only the blob server has two names (``image serve`` is the older one).
    shared = sorted(names for names in handlers.values() if len(names) > 1)
    assert all(names[0].startswith("blob serve ") and names[1].startswith("image serve ") for names in shared)


# The command lines the console sends (clusters/, machines/, deployments/), with the values it fills in.
CONSOLE_CALLS = [
    ["facts"],
    ["heartbeat", "start", "--url", "http://198.18.0.1:8000/agent/heartbeat/", "--interval", "10"],
    ["image", "serve", "start", "--bind", "198.18.1.11", "--port", "7470"],
    ["image", "serve", "stop"],
    ["image", "fetch"],
    ["image", "load", "--digest", DIGEST],
    ["runtime", "start", "--digest", DIGEST],
    ["image", "load", "--digest", DIGEST, "--driver", "podman"],
    ["runtime", "start", "--digest", DIGEST, "--cluster", "alpha", "--driver", "docker"],
    ["runtime", "status"],
    ["runtime", "stop"],
    ["ray", "start-head", "--address", "198.18.1.11", "--port", "6379", "--num-gpus", "8"],
    ["ray", "join", "--head", "198.18.1.11:6379", "--address", "198.18.1.12", "--num-gpus", "8"],
    ["ray", "reach", "--head", "198.18.1.11:6379"],
    ["ray", "status", "--head", "198.18.1.11:6379"],
    ["ray", "stop"],
    ["probe", "serve", "--bind", "198.18.1.12", "--port", "7471", "--seconds", "3"],
    ["probe", "send", "--to", "198.18.1.12", "--port", "7471", "--seconds", "3"],
    ["copy", "start"],
    ["copy", "stop", "--copy", "d7-c3", "--timeout", "30"],
    ["copy", "list"],
    ["node", "files", "write"],
    ["node", "files", "remove"],
    ["shared", "status"],
    ["shared", "export", "--method", "sshfs", "--members", "198.18.1.12,198.18.1.13"],
    ["shared", "mount", "--head", "198.18.1.11", "--method", "nfs"],
    ["shared", "unmount"],
    ["allreduce", "run"],
    ["cluster", "secrets", "write", "--cluster", "alpha"],
    ["cluster", "secrets", "remove", "--cluster", "alpha"],
    ["firewall", "write", "--cluster", "gpu-room"],
    ["firewall", "remove", "--cluster", "gpu-room"],
    ["firewall", "status", "--cluster", "gpu-room"],
    ["node", "revocations", "write", "--cluster", "gpu-room"],
]


@pytest.mark.parametrize("argv", CONSOLE_CALLS, ids=lambda argv: " ".join(argv[:3]))
def test_every_command_line_the_console_sends_still_parses(argv):
    words = tuple(itertools.takewhile(lambda word: not word.startswith("-"), argv))
    args = cli.build_parser().parse_args(argv)
    assert cli.handler_for(args) is cli.COMMANDS[words].handler


def _imports(path: str) -> set:
    """Sibling modules a module imports, at the top or inside functions."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_the_agent_package_has_no_import_cycles():
    modules = {n[:-3] for n in os.listdir(PACKAGE_DIR) if n.endswith(".py")}
    graph = {m: _imports(os.path.join(PACKAGE_DIR, m + ".py")) & modules for m in modules}

    def path_back(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    cycles = [path_back(m) for m in sorted(modules) if path_back(m)]
    assert cycles == [], "import cycles: %s" % ["  ->  ".join(c) for c in cycles]


def test_no_module_imports_inside_a_function():
    for name in sorted(os.listdir(PACKAGE_DIR)):
        if not name.endswith(".py"):
            continue
        path = os.path.join(PACKAGE_DIR, name)
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [n for n in ast.walk(func) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner, "%s: %s imports inside the function" % (name, func.name)
