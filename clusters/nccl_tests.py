"""The NCCL test of a cluster (issue 13): who may start one and when, the record it keeps, and the
sentences it ends with. The job that runs it is clusters/runners/nccl.py; the numbers come from
clusters/nccl.py's parser.

Rules, in the order they are asked: the role (Administrators and Operators start a test, Viewers
read the results), one test at a time per cluster (the refusal names who started the running one
and when), every machine Up (the Connect card's sentence), and, since the test takes every GPU,
confirmation while copies of models serve on the cluster. The page and the API ask the same rules
and read the same sentences.
"""
from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from clusters import connection_info, hooks, nccl, steps
from clusters.models import Cluster, NcclTest, NcclTestState, NetworkMeasurement
from console import live, roles
from console.jobs import job_start
from console.models import Job
from console.offers import ALLOWED, Offer
from console.roles import OPERATOR, Action

RUN = Action("running the NCCL test", OPERATOR)
LIVE_PART = "nccl"  # the part of the cluster's page topic that renders the card alone (pages.page_cards)
JOB_TARGET = "nccl_test"  # the job acts on the test's row, not the cluster: it holds up no operation on it
STOPPED_WORKER = "The worker running the test stopped before it finished: run it again."


class NcclTestConflict(Exception):
    """A test cannot start now because of another test or of serving copies (a 409 in the API).
    ``confirm``: the refusal goes away when the person confirms (copies serve)."""

    def __init__(self, message: str, *, confirm: bool = False):
        super().__init__(message)
        self.message, self.confirm = message, confirm


# -- the sentences -----------------------------------------------------------------------------------


def size_words(size_bytes: int) -> str:
    """``64 MiB``, ``1 GiB``, ``512 KiB``: a message size as nccl-tests' sweeps double it."""
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale} {unit}"
    return f"{size_bytes} B"


def gb_words(gb_per_s: float) -> str:
    """A bandwidth in GB/s as nccl-tests prints it (two decimals), with three figures below 1 GB/s so that
    a slow link does not read 0.00: ``22.88``, ``0.0437``."""
    return f"{gb_per_s:.2f}" if gb_per_s >= 1 or gb_per_s == 0 else f"{gb_per_s:.3g}"


def peak_words(peak: dict | None) -> str:
    """``Peak 22.88 GB/s at 64 MiB``: what the chart and the message name."""
    return f"Peak {gb_words(peak['busbw'])} GB/s at {size_words(peak['size_bytes'])}" if peak else "No size finished"


def running_refusal(test: NcclTest) -> str:
    who = f" by {test.started_by.get_username()}" if test.started_by else ""
    return (f"An NCCL test is already running on {test.cluster.name} "
            f"(started {timezone.localtime(test.started_at):%H:%M}{who}).")


def serving_warning(cluster: Cluster, copies: int) -> str:
    """Why the test asks first: it takes every GPU of the cluster, and the copies serving there slow down."""
    verb = "copy is" if copies == 1 else "copies are"
    return f"{copies} {verb} serving on {cluster.name}'s GPUs: the test uses every GPU and slows them."


def limit_words(seconds: int) -> str:
    if seconds % 60 == 0:
        return f"{seconds // 60} minute{'' if seconds == 60 else 's'}"
    return f"{seconds} second{'' if seconds == 1 else 's'}"


def limit_sentence(sizes_done: int, limit_seconds: int) -> str:
    """The test ran out of time (FADEN_NCCL_TEST_LIMIT_SECONDS, 10 minutes by default)."""
    return (f"stopped after {sizes_done} size{'' if sizes_done == 1 else 's'}: the test reached its limit of "
            f"{limit_words(limit_seconds)}")


def finished_sentence(rows: list[dict], avg_busbw: float | None) -> str:
    peak = max(rows, key=lambda row: row["busbw"], default=None)
    average = f", average {gb_words(avg_busbw)} GB/s" if avg_busbw is not None else ""
    return f"{peak_words(peak)}{average} over {len(rows)} size{'' if len(rows) == 1 else 's'}."


def stopped_sentence(why: str, rows: list[dict]) -> str:
    """Why it stopped, then what it measured until then."""
    peak = max(rows, key=lambda row: row["busbw"], default=None)
    return f"{why}. {peak_words(peak)}." if peak else f"{why}."


def slowest_link(cluster: Cluster, machines: list[str]) -> tuple[str, str]:
    """The pair of the cluster's machines with the lowest rate the network test measured on the
    cluster's network, else the head and the next node: the link the slow-link sentence names.
    ``machines``: their names in rank order, head first (at least two)."""
    rows = (NetworkMeasurement.objects.filter(subnet=cluster.network, mbps__isnull=False,
                                              source__name__in=machines, target__name__in=machines)
            .order_by("mbps").values_list("source__name", "target__name").first())
    return tuple(rows) if rows else (machines[0], machines[1])


# -- the rules ---------------------------------------------------------------------------------------


def running_test(cluster: Cluster) -> NcclTest | None:
    return NcclTest.objects.select_related("cluster", "started_by").filter(cluster=cluster, state=NcclTestState.RUNNING).first()


def nccl_test_offer(cluster: Cluster, role: roles.Role | None) -> Offer:
    """The Run the NCCL test button for ``role``: the role first, then a running test, then every
    machine Up. Serving copies do not grey it out: they ask for confirmation (``serving_copies``)."""
    permitted = RUN.offer(role)
    if not permitted.ok:
        return permitted
    if (running := running_test(cluster)) is not None:
        return Offer(False, running_refusal(running))
    try:
        nodes = connection_info.connection_of(cluster).nodes
    except connection_info.NotConnectable as waiting:
        return Offer(False, str(waiting))
    return ALLOWED


def sweep_sizes() -> list[int]:
    """FADEN_NCCL_TEST_MIN_BYTES (1 MiB) up to FADEN_NCCL_TEST_MAX_BYTES, doubling."""
    return nccl.sizes(settings.FADEN_NCCL_TEST_MIN_BYTES, settings.FADEN_NCCL_TEST_MAX_BYTES)


def nccl_test_start(*, cluster: Cluster, user=None, confirm: bool = False) -> NcclTest:
    """Start the NCCL test of ``cluster``: its record (Running) and its job, enqueued on commit.

    Refused (PermissionDenied) for a Viewer; NcclTestConflict while a test runs on the cluster, or
    while copies serve and ``confirm`` is not given; ValidationError with the Connect card's
    sentence while not every machine is Up. The cluster's row is locked, so two starts at once
    cannot both pass the one-test rule (the table's constraint holds it too)."""
    RUN.offer(roles.acting(user)).check()
    with transaction.atomic():
        cluster = Cluster.objects.select_for_update(no_key=True).get(pk=cluster.pk)
        if (running := running_test(cluster)) is not None:
            raise NcclTestConflict(running_refusal(running))
        try:
            nodes = connection_info.connection_of(cluster).nodes
        except connection_info.NotConnectable as waiting:
            raise ValidationError(str(waiting)) from None
        if (copies := hooks.serving_copies(cluster)) and not confirm:
            raise NcclTestConflict(serving_warning(cluster, copies), confirm=True)
        planned = sweep_sizes()
        test = NcclTest.objects.create(
            cluster=cluster, started_by=user if user is not None and user.is_authenticated else None,
            nodes=len(nodes), gpus=sum(node.gpus for node in nodes), minbytes=planned[0], maxbytes=planned[-1],
            iters=settings.FADEN_NCCL_TEST_ITERS, warmup=settings.FADEN_NCCL_TEST_WARMUP,
        )
        test.job = job_start(kind=steps.NCCL_TEST.kind, title=f"NCCL test of {cluster.name}", target_type=JOB_TARGET,
                             target_id=test.pk, steps=steps.NCCL_TEST.step_names, user=user)
        test.save(update_fields=["job"])
        live.push(f"cluster:{cluster.pk}", part=LIVE_PART)
    return test


# -- the record, as the job writes it ----------------------------------------------------------------


def nccl_test_rows_save(test: NcclTest, rows: list[dict]) -> None:
    """The sizes measured so far, saved and pushed to the cluster's page as each one finishes."""
    test.rows = rows
    test.save(update_fields=["rows"])
    live.push(f"cluster:{test.cluster_id}", part=LIVE_PART)


def nccl_test_end(test: NcclTest, *, state: NcclTestState, message: str, avg_busbw: float | None = None) -> None:
    """End the test once: a test that already ended (the reaper was first, say) keeps its end."""
    test.state, test.message, test.avg_busbw, test.finished_at = state, message, avg_busbw, timezone.now()
    ended = NcclTest.objects.filter(pk=test.pk, state=NcclTestState.RUNNING).update(
        state=state, message=message, avg_busbw=avg_busbw, finished_at=test.finished_at, rows=test.rows)
    if ended:
        live.push(f"cluster:{test.cluster_id}", part=LIVE_PART)


def nccl_test_abandoned(job: Job) -> None:
    """The reaper gave up on the test's job (its worker died): the test fails with the sentence
    instead of reading Running for ever, which would also refuse every next test."""
    test = NcclTest.objects.filter(pk=job.target_id).first()
    if test is not None:
        nccl_test_end(test, state=NcclTestState.FAILED, message=STOPPED_WORKER)
