"""The NCCL test's job: nccl-tests' all_reduce_perf across every node, run by the head's agent
(``fadenstack-agent allreduce run``), each size saved and pushed to the cluster's page as it
finishes, and the stop rules applied after every size.

The rules (clusters/nccl.py): the test stops at FADEN_NCCL_TEST_LIMIT_SECONDS (10 minutes); from the
fifth size on it stops at once when the sizes left would not fit in the time left, and says which
link is the slow one. Stopping is the agent call's abort: the agent kills the run on every node.
"""
from __future__ import annotations

import time

from django.conf import settings

from clusters import nccl, nccl_tests
from clusters.connection_texts import Node, NotConnectable, nodes_of
from clusters.models import NcclTest, NcclTestState
from clusters.steps import RUN_ALLREDUCE
from console.jobs import JobContext
from console.models import Job
from machines.agent_client import Agent, AgentError
from machines.models import Machine

SLOW_LINK_AFTER = 5  # sizes measured before the projection may stop the test
AGENT_MARGIN = 60  # seconds the agent's own timeout leaves the console's limit to act first


def now() -> float:
    """The runner's clock (monotonic seconds): the tests set it to run ten minutes in no time."""
    return time.monotonic()


def row_of(result: nccl.SizeResult) -> dict:
    """A parsed size as the record keeps it: the better of out of place and in place, with its
    algorithm bandwidth (bytes over time, GB/s, as nccl-tests computes it)."""
    in_place = result.busbw_in_place > result.busbw_out_of_place and result.time_in_place_us
    time_us = result.time_in_place_us if in_place else result.time_us
    algbw = result.size_bytes / time_us / 1e3 if time_us else 0.0
    return {"size_bytes": result.size_bytes, "time_us": time_us, "algbw": round(algbw, 2), "busbw": result.busbw}


def may_be_row(line: str) -> bool:
    """A line that starts with a size, after mpirun's ``[1,0]<stdout>:`` tag if it has one."""
    words = line.split()
    if words and words[0].endswith(">:"):
        words = words[1:]
    return bool(words) and words[0].isdigit()


class Sweep:
    """The run as it comes in, line by line: the rows so far, and whether a stop rule has ended it.

    ``stop_reason`` set means the console decided to stop (the abort then ends the agent call);
    ``feed`` parses again only when a line may be a row, since NCCL's INFO lines can be many."""

    def __init__(self, test: NcclTest, link: tuple[str, str], *, limit_seconds: int, clock=None):
        self.test, self.link, self.limit_seconds, self._clock = test, link, limit_seconds, clock or now
        self.planned = nccl.sizes(test.minbytes, test.maxbytes)
        self.started = self._clock()
        self.lines: list[str] = []
        self.parsed: tuple[nccl.SizeResult, ...] = ()
        self.stop_reason = ""

    @property
    def elapsed(self) -> float:
        return self._clock() - self.started

    def text(self) -> str:
        return "\n".join(self.lines)

    def feed(self, line: str) -> None:
        self.lines.append(line.rstrip("\n"))
        if self.stop_reason or not may_be_row(line):
            return
        try:
            rows = nccl.parse_all_reduce(self.text()).rows
        except nccl.NcclOutputError:
            return  # a number before the table's header: not a row
        if len(rows) > len(self.parsed):
            self.parsed = rows
            nccl_tests.nccl_test_rows_save(self.test, [row_of(r) for r in rows])
            self.apply_rules()

    def remaining(self) -> list[int]:
        done = max((r.size_bytes for r in self.parsed), default=0)
        return [size for size in self.planned if size > done]

    def apply_rules(self) -> None:
        """After each size: the time limit, then the slow link's projection (nothing to stop after the last)."""
        rest, test = self.remaining(), self.test
        if not rest:
            return
        if self.elapsed >= self.limit_seconds:
            self.stop_reason = nccl_tests.limit_sentence(len(self.parsed), self.limit_seconds)
            return
        if nccl.should_stop(self.parsed, rest, elapsed_seconds=self.elapsed, limit_seconds=self.limit_seconds,
                            after_sizes=SLOW_LINK_AFTER, warmup=test.warmup, iters=test.iters):
            seconds = nccl.projected_seconds(self.parsed, rest, warmup=test.warmup, iters=test.iters)
            self.stop_reason = nccl.slow_link_sentence(len(self.parsed), self.link, seconds)

    def abort(self, job_id: int):
        """Asked every second or so while the agent runs: a stop rule's sentence, the limit passed
        while a size still runs, or the job's cancel flag."""
        if not self.stop_reason and self.elapsed >= self.limit_seconds:
            self.stop_reason = nccl_tests.limit_sentence(len(self.parsed), self.limit_seconds)
        if not self.stop_reason and Job.objects.filter(pk=job_id, cancel_requested=True).exists():
            self.stop_reason = f"stopped after {len(self.parsed)} sizes: it was cancelled"
        return self.stop_reason or None


def allreduce_spec(test: NcclTest, nodes: list[Node], *, limit_seconds: int) -> dict:
    """What the head's agent is told (docs/agent-protocol.md): the nodes in rank order, head first."""
    return {"cluster": test.cluster.name,
            "nodes": [{"name": node.name, "address": node.address, "gpus": node.gpus} for node in nodes],
            "minbytes": test.minbytes, "maxbytes": test.maxbytes, "iters": test.iters, "warmup": test.warmup,
            "check": True, "timeout": limit_seconds + AGENT_MARGIN}


def program_words(result, sweep: Sweep) -> str:
    """The program's own last words: stderr's last lines, else the last line it printed that is no row."""
    tail = [line.strip() for line in result.stderr_tail if line.strip()]
    if tail:
        return " ".join(tail[-2:])
    printed = [line.strip() for line in sweep.lines if line.strip() and not line.strip()[0].isdigit()]
    return printed[-1] if printed else "it printed nothing"


def outcome(sweep: Sweep, result) -> tuple[NcclTestState, str, float | None]:
    """How the run ended, from the agent's result and what it printed."""
    rows = [row_of(r) for r in sweep.parsed]
    if sweep.stop_reason:
        return NcclTestState.STOPPED, nccl_tests.stopped_sentence(sweep.stop_reason, rows), None
    if result.timed_out:
        why = nccl_tests.limit_sentence(len(rows), sweep.limit_seconds)
        return NcclTestState.STOPPED, nccl_tests.stopped_sentence(why, rows), None
    if result.exit_status != 0:
        return (NcclTestState.FAILED, f"all_reduce_perf failed with exit status {result.exit_status} after "
                f"{len(rows)} size{'' if len(rows) == 1 else 's'}: {program_words(result, sweep)}", None)
    try:
        run = nccl.parse_all_reduce(sweep.text())
    except nccl.NcclOutputError as refused:
        return NcclTestState.FAILED, str(refused), None
    rows = [row_of(r) for r in run.rows]
    sweep.test.rows = rows
    if run.out_of_bounds:
        return (NcclTestState.FAILED, f"{run.out_of_bounds} values were wrong after the all-reduce (nccl-tests' check): "
                f"the network or the GPUs corrupt data. {nccl_tests.peak_words(run.peak and row_of(run.peak))}.", None)
    if not rows:
        return NcclTestState.FAILED, f"all_reduce_perf measured no size: {program_words(result, sweep)}", None
    return NcclTestState.FINISHED, nccl_tests.finished_sentence(rows, run.avg_busbw), run.avg_busbw


def nccl_test_run(ctx: JobContext, *, test_id: int) -> None:
    """Run the test on the head and end its record, whatever happens: a test never stays Running."""
    test = NcclTest.objects.select_related("cluster").get(pk=test_id)
    if test.state != NcclTestState.RUNNING:
        return  # a task delivered again after the test ended
    RUN_ALLREDUCE.always(ctx, f"{nccl_tests.size_words(test.minbytes)} to {nccl_tests.size_words(test.maxbytes)}")
    try:
        state, message, average = _run(ctx, test)
    except Exception as exc:
        nccl_tests.nccl_test_end(test, state=NcclTestState.FAILED, message=f"The test broke: {exc}")
        raise
    nccl_tests.nccl_test_end(test, state=state, message=message, avg_busbw=average)
    ctx.log(message)


def _run(ctx: JobContext, test: NcclTest) -> tuple[NcclTestState, str, float | None]:
    cluster, limit = test.cluster, settings.FADEN_NCCL_TEST_LIMIT_SECONDS
    try:
        nodes = nodes_of(cluster)
    except NotConnectable as waiting:
        return NcclTestState.FAILED, str(waiting), None
    if len(nodes) < 2:
        return NcclTestState.FAILED, f"{cluster.name} has one machine: an all-reduce across nodes needs two.", None
    sweep = Sweep(test, nccl_tests.slowest_link(cluster, [n.machine for n in nodes]), limit_seconds=limit)
    head = Machine.objects.get(name=nodes[0].machine)
    ctx.log(f"all_reduce_perf on {len(nodes)} nodes from {head.name}: {len(sweep.planned)} sizes, "
            f"{test.warmup} warm-up and {test.iters} timed all-reduces each, at most {nccl_tests.limit_words(limit)}")
    try:
        with Agent.open(head) as agent:
            result = agent.allreduce_run(allreduce_spec(test, nodes, limit_seconds=limit), on_line=sweep.feed,
                                         abort=lambda: sweep.abort(ctx.job.pk), timeout=limit + 2 * AGENT_MARGIN)
    except AgentError as exc:
        rows = [row_of(r) for r in sweep.parsed]
        if sweep.stop_reason:  # our abort ended the call
            return NcclTestState.STOPPED, nccl_tests.stopped_sentence(sweep.stop_reason, rows), None
        return NcclTestState.FAILED, f"The all-reduce could not run on {head.name}: {exc.message}", None
    if result.exit_status != 0:
        for line in result.stderr_tail:  # the program's own words in full, for the job's log
            ctx.log(f"{head.name}: {line.rstrip()}")
    return outcome(sweep, result)
