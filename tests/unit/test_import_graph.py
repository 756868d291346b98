"""The modules of each package import each other without cycles, so each package reads bottom-up.

import-linter holds the layers between the packages (pyproject.toml, ``make lint``); it has no
contract for cycles between the modules of one package. This builds the import graph with grimp
(which import-linter installs), imports inside functions included on purpose, and names the
modules and the import lines of every cycle it finds.
"""
import sys
from collections import deque
from pathlib import Path

import grimp
import pytest

AGENT_DIR = str(Path(__file__).resolve().parents[2] / "agent")
PACKAGES = ["config", "console", "machines", "clusters", "deployments", "lab", "fadenstack_agent", "client"]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # The agent's package lives at agent/fadenstack_agent; it is parsed, never imported.
    if AGENT_DIR not in sys.path:
        sys.path.insert(0, AGENT_DIR)
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def imports_within(graph: grimp.ImportGraph, package: str) -> dict[str, set[str]]:
    modules = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that reach each other (the cycles), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges[successor]))))
                    break
                if successor in on_stack:
                    low[module] = min(low[module], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == module:
                            break
                    if len(group) > 1 or module in edges[module]:
                        groups.append(sorted(group))
    return groups


def shortest_cycle(edges: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """start -> ... -> start, the fewest imports, through modules of one group only."""
    came_from = {start: None}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for successor in sorted(edges[module] & within):
            if successor == start:
                path = [module]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if successor not in came_from:
                came_from[successor] = module
                queue.append(successor)
    return [start]


def describe(graph: grimp.ImportGraph, edges: dict[str, set[str]], group: list[str]) -> str:
    """The shortest cycle through the group's first module, then every import among its modules."""

    def line(importer: str, imported: str) -> str:
        details = graph.get_import_details(importer=importer, imported=imported)[:1]
        where = "".join(f" (l.{d['line_number']}: {d['line_contents']})" for d in details)
        return f"    {importer} -> {imported}{where}"

    cycle = shortest_cycle(edges, group[0], set(group))
    lines = [f"cycle among {', '.join(group)}:", *(line(a, b) for a, b in zip(cycle, cycle[1:]))]
    if len(group) > 2:
        lines.append("  every import among them:")
        lines += [line(a, b) for a in group for b in sorted(edges[a] & set(group))]
    return "\n".join(lines)


def test_the_cycle_finder_names_a_cycle_and_ignores_a_chain():
    edges = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": set()}
    assert strongly_connected(edges) == [["p.a", "p.b", "p.c"]]
    assert shortest_cycle(edges, "p.a", {"p.a", "p.b", "p.c"}) == ["p.a", "p.b", "p.c", "p.a"]
    assert strongly_connected({"p.a": {"p.b"}, "p.b": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_the_modules_of_a_package_import_each_other_without_cycles(graph, package):
    edges = imports_within(graph, package)
    assert edges, f"grimp found no module of {package}"
    cycles = strongly_connected(edges)
    assert not cycles, "\n" + "\n".join(describe(graph, edges, group) for group in cycles)
