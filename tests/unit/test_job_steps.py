"""Every app names its jobs' steps once, as ``console.jobs.Step`` objects in an ``Operation``: the service
lists the operation's step names up front and the runner begins each step through the same object. A step
named as a string in a runner (``ctx.step("Connect")``) could drift from the list the job's card shows."""
import ast
import importlib
from pathlib import Path

from console.jobs import JobContext, Operation, Step

ROOT = Path(__file__).resolve().parents[2]
SERVER = ("config", "console", "machines", "clusters", "deployments")
STEP_CALLS = {"step", "done", "skip"}  # JobContext's methods that take a step's name
# The modules that define operations: each operation's steps are named once within it.
OPERATION_MODULES = ("clusters.steps", "machines.steps", "deployments.store.downloads", "deployments.store.machine_files",
                     "deployments.store.sources", "deployments.serving", "clusters.leftovers")


def named_by_string(tree: ast.AST) -> list[int]:
    """The lines where ``ctx.step``, ``ctx.done`` or ``ctx.skip`` get a step's name as a string literal."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STEP_CALLS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "ctx"
            and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr))]


def test_no_runner_names_a_step_by_a_string():
    spelt = []
    for package in SERVER:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" not in path.parts:
                tree = ast.parse(path.read_text(encoding="utf-8"))
                spelt += [f"{path.relative_to(ROOT)}:{line}" for line in named_by_string(tree)]
    assert not spelt, "Begin these steps through their Step object (console.jobs.Step):\n" + "\n".join(spelt)


def test_the_check_finds_a_step_named_by_a_string():
    assert named_by_string(ast.parse('ctx.step("Connect", "x")\nSTEP.always(ctx)\nctx.done(f"{a}")\nctx.step(name)')) == [1, 3]


def test_each_operation_names_its_steps_once_and_each_step_has_one_name_per_module():
    for name in OPERATION_MODULES:
        module = importlib.import_module(name)
        operations = [v for v in vars(module).values() if isinstance(v, Operation)]
        steps = [v for v in vars(module).values() if isinstance(v, Step)]
        assert operations, f"{name} defines no operation"
        for operation in operations:
            assert len(set(operation.step_names)) == len(operation.step_names), f"{name}: {operation.kind} repeats a step"
            assert all(isinstance(step, Step) for step in operation.steps)
        assert len({s.name for s in steps}) == len(steps), f"{name}: two steps share a name"


class _Ctx(JobContext):
    """Records the steps begun, with the finished ones an earlier run left."""

    def __init__(self, finished=()):
        self.begun, self.finished = [], set(finished)

    def done(self, name):
        return name in self.finished

    def step(self, name, detail=""):
        self.begun.append((name, detail))


def test_a_step_begun_skips_itself_when_an_earlier_run_finished_it_and_always_runs_again_regardless():
    fetch, check = Step("Fetch"), Step("Check")
    ctx = _Ctx(finished={"Fetch", "Check"})

    assert fetch.begin(ctx, "again?") is False
    check.always(ctx, "every run")

    assert ctx.begun == [("Check", "every run")]
    assert Operation("x.fetch", (fetch, check)).step_names == ["Fetch", "Check"]
