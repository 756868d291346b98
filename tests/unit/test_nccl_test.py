"""The NCCL test of a cluster: its rules (roles, one at a time, every machine Up, confirmation while
copies serve), its job replaying recorded all_reduce_perf outputs through the head's agent (sizes
saved as they finish, the stop rules, the abort, a failure in the program's own words), and its card."""
from html import unescape
from pathlib import Path

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.template.loader import render_to_string
from django.utils import timezone

from clusters import nccl, nccl_card, nccl_tests, pages, selectors, steps, tasks
from clusters.choices import MemberState
from clusters.models import NcclTest, NcclTestState, NetworkMeasurement
from console import live, roles
from console.models import Job
from deployments.choices import CopyState
from deployments.models import Copy
from machines.models import Machine
from tests.builders import NETWORK, cluster_of, deployment_of, gpu_machine, ready_model
from tests.factories import UserFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db

# The Connect card's sentence for gpu-b while it starts Ray (clusters/connection_info.py waiting_for).
MESSAGE_NOT_UP = "Waiting for gpu-b to be Up: it is starting Ray."
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nccl"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


class Watch:
    """What the replay shows while it runs (FakeAgents.on_allreduce_line): the record's rows after each
    line, and the last line delivered; ``clock``/``step``: the runner's clock, advanced before each row."""

    def __init__(self, fakes: FakeAgents, lines: list[str], *, clock: list | None = None, step: float = 0.0):
        self.lines, self.clock, self.step = lines, clock, step
        self.rows_seen: list[int] = []
        self.last_line = -1
        fakes.on_allreduce_line = self.after

    def after(self, index: int) -> None:
        self.last_line = index
        if index + 1 < len(self.lines) and is_row(self.lines[index + 1]) and self.clock is not None:
            self.clock[0] += self.step  # the next size takes this long
        if is_row(self.lines[index]):
            self.rows_seen.append(len(NcclTest.objects.order_by("-pk").first().rows))


def is_row(line: str) -> bool:
    words = line.removeprefix("[1,0]<stdout>:").split()  # mpirun --tag-output's tag, when a test adds it
    return bool(words) and words[0].isdigit()


def program_lines(name: str, rows: int | None = None) -> list[str]:
    """A recorded output as the program printed it (without the fixture's source line); ``rows``: cut
    after that many sizes, as a run ended early prints it."""
    lines = [line for line in fixture(name).splitlines() if not line.startswith("# Source:")]
    if rows is None:
        return lines
    row_indexes = [i for i, line in enumerate(lines) if is_row(line)]
    return lines[:row_indexes[rows - 1] + 1]


def replaying(monkeypatch, lines: list[str], *, clock: list | None = None, step: float = 0.0, **result) -> tuple[FakeAgents, Watch]:
    """The head gpu-a's agent replays ``lines`` as all_reduce_perf's output, then ends with ``result``
    (exit_status, timed_out, stderr_tail)."""
    fakes = FakeAgents({"gpu-a": {"allreduce": {"lines": lines, **result}}}).install(monkeypatch)
    return fakes, Watch(fakes, lines, clock=clock, step=step)


def allreduce_calls(fakes: FakeAgents) -> list[tuple[str, dict]]:
    return [(machine, kwargs) for machine, method, kwargs in fakes.calls if method == "allreduce_run"]


@pytest.fixture
def room():
    """gpu-room, running: gpu-a leads, gpu-b follows, 8 GPUs each."""
    return cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)])


@pytest.fixture
def operator():
    return UserFactory(username="ann", role=roles.OPERATOR)


@pytest.fixture
def sweep(settings):
    """The full 1 MiB to 1 GiB sweep with nccl-tests' default iterations, 10 minutes at most."""
    settings.FADEN_NCCL_TEST_MAX_BYTES = 1024 ** 3
    settings.FADEN_NCCL_TEST_ITERS, settings.FADEN_NCCL_TEST_WARMUP = 20, 5
    settings.FADEN_NCCL_TEST_LIMIT_SECONDS = 600
    return settings


@pytest.fixture
def pushes(monkeypatch):
    calls = []
    monkeypatch.setattr(live, "push", lambda topic, part="": calls.append((topic, part)))
    return calls


def run_test(cluster, user) -> NcclTest:
    test = nccl_tests.nccl_test_start(cluster=cluster, user=user)
    tasks.nccl_test(test.job_id)
    test.refresh_from_db()
    return test


def serving_copy(cluster, number: int = 1) -> Copy:
    deployment = deployment_of(cluster, ready_model(f"org/chat-{number}"), name=f"chat-{number}")
    return Copy.objects.create(deployment=deployment, number=1, state=CopyState.SERVING, address="198.18.1.11", port=8100 + number)


# -- the rules -------------------------------------------------------------------------------------


def test_a_viewer_is_refused_with_the_roles_sentence_and_no_test_is_written(room):
    viewer = UserFactory(username="vic", role=roles.VIEWER)
    with pytest.raises(PermissionDenied, match="Your role is Viewer: running the NCCL test needs an Operator."):
        nccl_tests.nccl_test_start(cluster=room, user=viewer)
    assert not NcclTest.objects.exists()


def test_a_start_writes_the_running_test_with_the_settings_sweep_and_its_own_job(room, operator, settings):
    settings.FADEN_NCCL_TEST_MAX_BYTES, settings.FADEN_NCCL_TEST_ITERS, settings.FADEN_NCCL_TEST_WARMUP = 64 * nccl.MiB, 2, 1
    test = nccl_tests.nccl_test_start(cluster=room, user=operator)

    assert (test.state, test.nodes, test.gpus, test.minbytes, test.maxbytes, test.iters, test.warmup) == (
        NcclTestState.RUNNING, 2, 16, nccl.MiB, 64 * nccl.MiB, 2, 1)
    job = Job.objects.get(pk=test.job_id)
    assert (job.kind, job.target_type, job.target_id, [s["name"] for s in job.steps]) == (
        steps.NCCL_TEST.kind, "nccl_test", test.pk, ["Run the all-reduce"])
    assert selectors.cluster_busy(room) is None  # the test holds up none of the cluster's operations


def test_a_second_test_is_refused_naming_who_started_the_running_one_and_when(room, operator):
    first = nccl_tests.nccl_test_start(cluster=room, user=operator)
    started = f"{timezone.localtime(first.started_at):%H:%M}"
    with pytest.raises(nccl_tests.NcclTestConflict) as refused:
        nccl_tests.nccl_test_start(cluster=room, user=UserFactory(username="bob", role=roles.ADMINISTRATOR))
    assert refused.value.message == f"An NCCL test is already running on gpu-room (started {started} by ann)."
    assert not refused.value.confirm and NcclTest.objects.count() == 1


def test_a_cluster_with_a_machine_not_up_is_refused_with_the_connect_cards_sentence(room, operator):
    room.members.filter(machine__name="gpu-b").update(state=MemberState.RAY)
    with pytest.raises(ValidationError) as refused:
        nccl_tests.nccl_test_start(cluster=room, user=operator)
    assert refused.value.messages == [MESSAGE_NOT_UP]
    assert not NcclTest.objects.exists()


def test_nodes_with_different_numbers_of_gpus_run_with_each_node_s_own_count(operator, monkeypatch, settings):
    settings.FADEN_NCCL_TEST_MAX_BYTES = 128 * nccl.MiB
    mixed = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13, accelerators=4)])
    assert nccl_tests.nccl_test_offer(mixed, roles.OPERATOR).ok
    fakes, _ = replaying(monkeypatch, program_lines("cscs-gh200-2.18.2.txt"))

    test = run_test(mixed, operator)

    [(_, call)] = allreduce_calls(fakes)
    assert [node["gpus"] for node in call["spec"]["nodes"]] == [8, 8, 4]  # the agent runs a process per GPU
    assert (test.nodes, test.gpus, test.state) == (3, 20, NcclTestState.FINISHED)
    assert test.message.startswith("Peak 22.88 GB/s at 128 MiB")


def test_serving_copies_ask_for_confirmation_and_a_confirmed_start_runs(room, operator):
    serving_copy(room, 1), serving_copy(room, 2)
    with pytest.raises(nccl_tests.NcclTestConflict) as refused:
        nccl_tests.nccl_test_start(cluster=room, user=operator)
    assert refused.value.confirm
    assert refused.value.message == "2 copies are serving on gpu-room's GPUs: the test uses every GPU and slows them."

    assert nccl_tests.nccl_test_start(cluster=room, user=operator, confirm=True).state == NcclTestState.RUNNING


# -- the job ---------------------------------------------------------------------------------------


def test_a_run_sends_the_nodes_head_first_saves_each_size_as_it_finishes_and_names_the_peak(room, operator, monkeypatch, pushes, settings):
    settings.FADEN_NCCL_TEST_MAX_BYTES = 128 * nccl.MiB
    fakes, watch = replaying(monkeypatch, program_lines("cscs-gh200-2.18.2.txt"))
    test = run_test(room, operator)

    [(machine, call)] = allreduce_calls(fakes)
    spec = call["spec"]
    assert machine == "gpu-a"
    assert spec["nodes"] == [{"name": "node-0", "address": "198.18.1.11", "gpus": 8},
                             {"name": "node-1", "address": "198.18.1.12", "gpus": 8}]
    assert (spec["minbytes"], spec["maxbytes"], spec["cluster"], spec["check"]) == (nccl.MiB, 128 * nccl.MiB, "gpu-room", True)
    assert watch.rows_seen == [1, 2, 3, 4, 5, 6, 7, 8]  # each size in the record as its line came
    assert test.state == NcclTestState.FINISHED and test.finished_at is not None
    assert test.message == "Peak 22.88 GB/s at 128 MiB, average 15.00 GB/s over 8 sizes."
    assert test.rows[0] == {"size_bytes": nccl.MiB, "time_us": 335.85, "algbw": 3.12, "busbw": 3.12}
    assert test.peak == test.rows[-1] and test.avg_busbw == pytest.approx(14.9966)
    assert pushes.count((f"cluster:{room.pk}", "nccl")) >= 10  # the start, each size, the end


def test_a_slow_link_stops_the_test_after_five_sizes_naming_the_slowest_measured_pair(room, operator, monkeypatch, sweep, pushes):
    third = gpu_machine("gpu-c", 13)
    room.members.create(machine=third, address="198.18.1.13", state=MemberState.JOINED)
    a, b = Machine.objects.get(name="gpu-a"), Machine.objects.get(name="gpu-b")
    NetworkMeasurement.objects.create(subnet=NETWORK, source=a, target=b, mbps=9400)
    NetworkMeasurement.objects.create(subnet=NETWORK, source=a, target=third, mbps=40)
    sweep.FADEN_NCCL_TEST_LIMIT_SECONDS = 120  # the recorded T4 run's sizes left would take about 3.5 minutes
    lines = program_lines("t4-3nodes-no-validation.txt")
    _fakes, watch = replaying(monkeypatch, lines)
    test = run_test(room, operator)

    parsed = nccl.parse_all_reduce(fixture("t4-3nodes-no-validation.txt")).rows[:5]
    rest = [size for size in nccl.sizes() if size > parsed[-1].size_bytes]
    seconds = nccl.projected_seconds(parsed, rest)
    assert 120 < seconds < 600
    sentence = nccl.slow_link_sentence(5, ("gpu-a", "gpu-c"), seconds)
    assert sentence.startswith("stopped after 5 sizes: the link between gpu-a and gpu-c would take about ")
    fifth = [i for i, line in enumerate(lines) if is_row(line)][4]
    assert watch.last_line == fifth  # aborted: the agent got no further, so every node's run ends
    assert test.state == NcclTestState.STOPPED and len(test.rows) == 5
    assert test.message == f"{sentence}. Peak 0.74 GB/s at 103 MiB."


def test_without_a_measured_link_the_sentence_names_the_head_and_node_1(room, operator, monkeypatch, sweep, pushes):
    sweep.FADEN_NCCL_TEST_LIMIT_SECONDS = 120
    replaying(monkeypatch, program_lines("t4-3nodes-no-validation.txt"))
    assert "the link between gpu-a and gpu-b would take" in run_test(room, operator).message


def test_a_fast_link_is_not_stopped_by_the_projection(room, operator, monkeypatch, sweep, pushes):
    replaying(monkeypatch, program_lines("cscs-gh200-2.18.2.txt"))
    assert run_test(room, operator).state == NcclTestState.FINISHED


def test_the_time_limit_stops_the_test_while_the_size_that_passes_it_runs(room, operator, monkeypatch, sweep, pushes):
    clock = [1000.0]
    monkeypatch.setattr("clusters.runners.nccl.now", lambda: clock[0])
    lines = program_lines("cscs-gh200-2.18.2.txt")
    _fakes, watch = replaying(monkeypatch, lines, clock=clock, step=100)  # fast sizes, 100 s each by the clock
    test = run_test(room, operator)

    # Five sizes take 500 s; the sixth would end at 600 s: the abort ends it at the limit, not after it.
    assert test.state == NcclTestState.STOPPED and len(test.rows) == 5
    assert test.message == "stopped after 5 sizes: the test reached its limit of 10 minutes. Peak 19.96 GB/s at 16 MiB."
    assert watch.last_line == [i for i, line in enumerate(lines) if is_row(line)][4]


def test_a_run_the_agent_timed_out_is_stopped_at_the_limit(room, operator, monkeypatch, sweep, pushes):
    replaying(monkeypatch, program_lines("cscs-gh200-2.18.2.txt", rows=3), exit_status=137, timed_out=True)
    test = run_test(room, operator)
    assert test.state == NcclTestState.STOPPED
    assert test.message == "stopped after 3 sizes: the test reached its limit of 10 minutes. Peak 8.90 GB/s at 4 MiB."


def test_a_failing_program_fails_the_test_in_its_own_words(room, operator, monkeypatch, sweep, pushes):
    words = "nid007109: Test NCCL failure common.cu:1005 'unhandled system error'"
    replaying(monkeypatch, program_lines("cscs-gh200-2.18.2.txt", rows=2), exit_status=3, stderr_tail=["", words])
    test = run_test(room, operator)
    assert test.state == NcclTestState.FAILED and len(test.rows) == 2
    assert test.message == f"all_reduce_perf failed with exit status 3 after 2 sizes: {words}"


def test_a_head_that_cannot_be_reached_fails_the_test_with_the_agents_words(room, operator, monkeypatch, sweep, pushes):
    FakeAgents({"gpu-a": {"error": "Could not connect to 198.18.0.11: timed out."}}).install(monkeypatch)
    test = run_test(room, operator)
    assert test.state == NcclTestState.FAILED
    assert test.message == "The all-reduce could not run on gpu-a: Could not connect to 198.18.0.11: timed out."


def test_output_without_a_table_fails_with_the_parsers_sentence(room, operator, monkeypatch, sweep, pushes):
    replaying(monkeypatch, ["mpirun was unable to launch the specified application"])
    test = run_test(room, operator)
    assert test.state == NcclTestState.FAILED and test.message.startswith("No all_reduce_perf table in the output")


def test_a_test_whose_worker_died_fails_with_the_sentence_and_frees_the_cluster(room, operator):
    test = nccl_tests.nccl_test_start(cluster=room, user=operator)
    nccl_tests.nccl_test_abandoned(Job.objects.get(pk=test.job_id))
    test.refresh_from_db()
    assert (test.state, test.message) == (NcclTestState.FAILED, nccl_tests.STOPPED_WORKER)
    assert nccl_tests.nccl_test_start(cluster=room, user=operator).state == NcclTestState.RUNNING


# -- the card --------------------------------------------------------------------------------------


def finished(cluster, rows_text: str = "cscs-gh200-2.18.2.txt") -> NcclTest:
    from clusters.runners.nccl import row_of

    run = nccl.parse_all_reduce(fixture(rows_text))
    return NcclTest.objects.create(cluster=cluster, state=NcclTestState.FINISHED, nodes=2, gpus=2, minbytes=nccl.MiB,
                                   maxbytes=128 * nccl.MiB, iters=20, warmup=5, rows=[row_of(r) for r in run.rows],
                                   avg_busbw=run.avg_busbw, message="Peak 22.88 GB/s at 128 MiB, average 15.00 GB/s over 8 sizes.")


def card_html(cluster, role) -> str:
    """The card as a browser reads its text (entities such as &#x27; decoded)."""
    return unescape(render_to_string("clusters/_nccl_card.html", {"cluster": cluster, "role": role} | nccl_card.nccl_card(cluster, role)))


def test_the_chart_puts_doubling_sizes_at_equal_steps_and_marks_the_peak():
    rows = [{"size_bytes": nccl.MiB * 2 ** i, "time_us": 1.0, "algbw": 1.0, "busbw": b} for i, b in enumerate([1, 4, 2])]
    drawn = nccl_card.chart(rows, nccl.sizes(nccl.MiB, 16 * nccl.MiB))
    xs = [t["x"] for t in drawn["x_ticks"]]
    assert xs[0] == nccl_card.LEFT and xs[-1] == nccl_card.WIDTH - nccl_card.RIGHT
    assert {round(b - a, 1) for a, b in zip(xs, xs[1:])} == {round((xs[-1] - xs[0]) / 4, 1)}
    assert [p.peak for p in drawn["points"]] == [False, True, False]
    assert drawn["peak_label"] == "Peak 4.00 GB/s at 2 MiB"
    assert drawn["points"][1].y < drawn["points"][2].y < drawn["points"][0].y  # higher bandwidth, higher up
    assert nccl_card.chart([], [nccl.MiB]) is None


def test_the_card_draws_the_last_test_with_its_sizes_chart_and_named_peak(room):
    finished(room)
    html = card_html(room, roles.OPERATOR)
    assert 'id="cluster-nccl"' in html and "<svg class=\"nccl-chart\"" in html
    assert "Peak 22.88 GB/s at 128 MiB</text>" in html
    assert html.count('<tr id="nccl-size-') == 8 and html.count("nccl-chart__point--peak") == 1
    assert "Peak 22.88 GB/s at 128 MiB, average 15.00 GB/s over 8 sizes." in html
    assert 'formaction="/clusters/%d/nccl-test/"' % room.pk in html


def test_a_viewer_sees_the_results_and_a_greyed_out_button_with_the_reason(room):
    finished(room)
    html = card_html(room, roles.VIEWER)
    assert "Your role is Viewer: running the NCCL test needs an Operator." in html
    assert "nccl-test/" not in html and "Peak 22.88 GB/s at 128 MiB</text>" in html


def test_with_copies_serving_the_button_opens_a_confirmation_first(room):
    serving_copy(room)
    html = card_html(room, roles.OPERATOR)
    assert 'data-dialog-open="nccl-dialog"' in html
    assert "1 copy is serving on gpu-room's GPUs: the test uses every GPU and slows them." in html
    assert 'name="confirm" value="1"' in html


def test_the_live_push_of_the_card_renders_it_alone_to_swap_in(room, operator):
    test = nccl_tests.nccl_test_start(cluster=room, user=operator)
    NcclTest.objects.filter(pk=test.pk).update(rows=finished(cluster_of([gpu_machine("x-a", 21)], name="other")).rows[:3])
    [html] = pages.render_cluster_topic(str(room.pk), "nccl", roles.OPERATOR)
    assert html.strip().startswith('<section id="cluster-nccl" class="card nccl-card" hx-swap-oob="true">')
    assert f"3 of {len(nccl.sizes(nccl.MiB, test.maxbytes))} sizes so far" in html
    assert "An NCCL test is already running on gpu-room" in html  # the button says why it waits


def test_the_cluster_page_shows_the_card(admin_client, room):
    finished(room)
    page = admin_client.get(f"/clusters/{room.pk}/").content.decode()
    assert 'id="cluster-nccl"' in page and "Peak 22.88 GB/s at 128 MiB" in page


def test_the_button_starts_a_test_and_a_second_press_says_why_not(admin_client, room, queued):
    first = admin_client.post(f"/clusters/{room.pk}/nccl-test/", follow=True)
    assert "The NCCL test runs on gpu-room" in first.content.decode()
    second = admin_client.post(f"/clusters/{room.pk}/nccl-test/", follow=True)
    assert "An NCCL test is already running on gpu-room" in second.content.decode()
    assert NcclTest.objects.filter(cluster=room).count() == 1


def test_the_dialogs_run_it_anyway_confirms_while_copies_serve(admin_client, room, queued):
    serving_copy(room)
    asked = admin_client.post(f"/clusters/{room.pk}/nccl-test/", follow=True)
    assert "1 copy is serving on gpu-room&#x27;s GPUs" in asked.content.decode() and not NcclTest.objects.exists()
    admin_client.post(f"/clusters/{room.pk}/nccl-test/", {"confirm": "1"})
    assert NcclTest.objects.get(cluster=room).state == NcclTestState.RUNNING


def test_rows_tagged_by_mpirun_are_saved_as_they_come_too(room, operator, monkeypatch, sweep, pushes):
    lines = [f"[1,0]<stdout>:{line}" for line in program_lines("cscs-gh200-2.18.2.txt")]
    _fakes, watch = replaying(monkeypatch, lines)
    test = run_test(room, operator)
    assert watch.rows_seen == [1, 2, 3, 4, 5, 6, 7, 8] and test.state == NcclTestState.FINISHED


def test_the_button_follows_the_cluster_in_the_members_and_whole_page_pushes(room):
    room.members.filter(machine__name="gpu-b").update(state=MemberState.RAY)
    [members] = pages.render_cluster_topic(str(room.pk), "members", roles.OPERATOR)
    assert 'id="cluster-nccl" class="card nccl-card" hx-swap-oob="true"' in members
    assert "Waiting for gpu-b to be Up" in unescape(members.split('id="cluster-nccl"')[1])
    room.members.update(state=MemberState.JOINED)
    [whole] = pages.render_cluster_topic(str(room.pk), "", roles.OPERATOR)
    assert f'formaction="/clusters/{room.pk}/nccl-test/"' in whole.split('id="cluster-nccl"')[1]
