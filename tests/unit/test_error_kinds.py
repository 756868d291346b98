"""A failure's kind is named through ``console.choices.ErrorKind`` everywhere in the server, never spelled
as a string: a misspelt literal ("not-retryable") would compare unequal in silence and turn a failure a
person must fix into one retried for ever. (The enum itself is held to the agent's own list in
tests/unit/test_agent_client.py.)"""
import ast
from pathlib import Path

from console.choices import ErrorKind

ROOT = Path(__file__).resolve().parents[2]
SERVER = ("config", "console", "machines", "clusters", "deployments")
KINDS = {kind.value for kind in ErrorKind}
NAMES = {"kind", "error_kind"}  # the parameters, attributes and variables that hold a kind


def _named_kind(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in NAMES) or (isinstance(node, ast.Attribute) and node.attr in NAMES)


def _literal(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value in KINDS


def _or_in(node: ast.AST | None) -> list[ast.AST]:
    """The value itself, or both branches of ``a if c else b``."""
    return [node.body, node.orelse] if isinstance(node, ast.IfExp) else [node]


def literal_kinds(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a kind is written as a string: ``kind="..."``, a parameter's default, ``x.kind == "..."``,
    ``"..." in kinds``, an assignment to a kind, and ``outcome.get("kind", "...")``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            values = [k.value for k in node.keywords if k.arg in NAMES]
            if isinstance(node.func, ast.Attribute) and node.func.attr == "get" and len(node.args) == 2 \
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in NAMES:
                values.append(node.args[1])
            found += [(v.lineno, v.value) for value in values for v in _or_in(value) if _literal(v)]
        elif isinstance(node, ast.arguments):
            named = [*node.posonlyargs, *node.args]
            pairs = list(zip(named[len(named) - len(node.defaults):], node.defaults)) + list(zip(node.kwonlyargs, node.kw_defaults))
            found += [(d.lineno, d.value) for a, d in pairs if a.arg in NAMES and _literal(d)]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_named_kind(s) or (isinstance(s, ast.Name) and s.id == "kinds") for s in sides):
                found += [(s.lineno, s.value) for s in sides if _literal(s)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_named_kind(t) for t in targets):
                found += [(v.lineno, v.value) for v in _or_in(node.value) if _literal(v)]
    return found


def test_no_server_module_spells_an_error_kind_as_a_string():
    spelt = []
    for package in SERVER:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            spelt += [f"{path.relative_to(ROOT)}:{line}: {value!r}" for line, value in literal_kinds(tree)]
    assert not spelt, "Name these kinds as ErrorKind members:\n" + "\n".join(spelt)


def test_the_check_finds_each_way_a_kind_is_written():
    source = '''
raise JobError("x", kind="not_retryable")
def f(message, *, kind="retryable"): pass
if exc.kind != "unreachable": pass
job.error_kind = "retryable"
kind = "no_room" if full else "retryable"
ok = "not_retryable" in kinds
kind = outcome.get("kind", "retryable")
words = ("unreachable", "the network is unreachable")
'''
    assert sorted(literal_kinds(ast.parse(source))) == [
        (2, "not_retryable"), (3, "retryable"), (4, "unreachable"), (5, "retryable"), (6, "no_room"), (6, "retryable"),
        (7, "not_retryable"), (8, "retryable")]
