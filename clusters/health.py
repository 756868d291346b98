"""Health checks of running clusters: look (Ray on the head, every member in Ray's node list, every
agent), record what was found, look again after about 20 s before repairing anything, then repair.

The decisions are pure (policy.diagnose, policy.decide); this module asks the machines and
records. A check runs outside any job: it only reads. A repair it decides is a job
(services.cluster_restart, services.cluster_rejoin), so one runs per cluster at a time.
Apps above clusters look at their own parts after each check (their ClusterExtension's after_check).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connections, transaction
from django.utils import timezone

from clusters import hooks, policy, selectors, services
from clusters.choices import CHECKED, CheckOutcome, CheckTrigger, MemberState, Role
from clusters.lifecycle import cluster_transition, members_transition
from clusters.models import Cluster, ClusterMember, HealthCheck, head_first
from console import live
from console.jobs import task_enqueue
from machines.agent_client import Agent, AgentError
from machines.choices import MachineState

log = logging.getLogger(__name__)

DOWN_STATES = (MemberState.DOWN, MemberState.FAILED)


def _ask(member: ClusterMember, gcs: str) -> dict:
    """One member's agent, in one SSH session: its runtime and local Ray, and on the head Ray's node list."""
    machine = member.machine
    answer: dict = {"machine": machine.name, "machine_state": machine.state}
    if machine.state == MachineState.OFFLINE:
        answer["error"] = f"offline: {machine.state_reason}" if machine.state_reason else "offline"
        return answer
    try:
        with Agent.open(machine) as agent:
            answer["runtime"] = agent.runtime_status().raw
            if member.role == Role.HEAD:
                try:
                    answer["ray"] = agent.ray_status(head=gcs, timeout=45).raw
                except AgentError as exc:
                    answer["ray_error"] = exc.message
            for extension in hooks.extensions():  # what apps above ask too (deployments: copies)
                try:
                    answer[extension.name] = extension.health_question(agent, member)
                except AgentError as exc:
                    answer[f"{extension.name}_error"] = exc.message
    except AgentError as exc:
        answer["error"] = exc.message
    finally:
        connections.close_all()
    return answer


def look(cluster: Cluster, members: list[ClusterMember]) -> tuple[policy.Look, dict[int, dict]]:
    """Ask every member at once (bounded), and turn the answers into the policy's Look."""
    gcs = f"{cluster.head_address}:{cluster.ray_port}"
    with ThreadPoolExecutor(max_workers=min(settings.FADEN_HEALTH_PARALLEL, max(1, len(members)))) as pool:
        answers = dict(zip([m.pk for m in members], pool.map(lambda m: _ask(m, gcs), members)))
    head = next(m for m in members if m.role == Role.HEAD)
    head_answer = answers[head.pk]
    nodes = (head_answer.get("ray") or {}).get("nodes")
    alive = {n.get("address"): n for n in nodes or [] if n.get("alive")}
    looks = []
    for member in members:
        answer = answers[member.pk]
        ray = (answer.get("runtime") or {}).get("ray") or {}
        looks.append(policy.MemberLook(
            member_id=member.pk,
            name=member.machine.name,
            is_head=member.role == Role.HEAD,
            machine_state=member.machine.state,
            machine_reason=member.machine.state_reason,
            answered="runtime" in answer,
            error=answer.get("error", ""),
            ray_running=(bool(ray.get("running")) and ray.get("gcs_address") == gcs) if "runtime" in answer else None,
            in_ray=(member.address in alive) if nodes is not None else None,
        ))
    head_error = head_answer.get("ray_error") or head_answer.get("error") or ""
    return policy.Look(members=tuple(looks), head_answered=nodes is not None, head_error=head_error), answers


def _record_member_states(cluster: Cluster, members: list[ClusterMember], findings: list[policy.Finding],
                          answers: dict[int, dict], decision: policy.Decision) -> None:
    """Members the check found gone read Out of the cluster with the reason (or failed, once repairs gave
    up on them); ones found back read Up."""
    by_member = {f.member_id: f for f in findings}
    head = next(m for m in members if m.role == Role.HEAD)
    # Ray keeps a node that left in its list, dead, beside the one that joined again at the same address: the
    # live one is the machine's (sorted last, so that it wins).
    listed = (answers[head.pk].get("ray") or {}).get("nodes") or []
    nodes = {n.get("address"): n for n in sorted(listed, key=lambda n: bool(n.get("alive")))}
    attempts = settings.FADEN_RESTART_ATTEMPTS
    for member in members:
        answer = answers[member.pk]
        node = nodes.get(member.address)
        status = {"runtime": answer.get("runtime"), "ray_node": node, "error": answer.get("error") or answer.get("ray_error") or ""}
        row = ClusterMember.objects.filter(pk=member.pk)
        finding = by_member.get(member.pk)
        if finding and member.pk in decision.given_up:
            members_transition(row, to=MemberState.FAILED, reason=policy.gave_up_words(member.machine.name, attempts, finding.text),
                               last_status=status)
        elif finding and finding.problem == policy.NO_ANSWER:
            row.update(state_reason=finding.text, last_status=status)  # still a live node of Ray: not out of the cluster
        elif finding and member.state in (MemberState.REJOINING, MemberState.FAILED):
            # Being joined again, or never joined (its own reason says why): not "was up, now gone".
            row.update(last_status=status)
        elif finding:
            members_transition(row, to=MemberState.DOWN, reason=finding.text, last_status=status)
        elif node and node.get("alive") and member.state in DOWN_STATES:
            members_transition(row, to=MemberState.JOINED, accelerators_in_ray=member.machine.accelerators.count(),
                               ray_node_id=str(node.get("node_id", ""))[:64], rejoin_attempts=0, last_status=status)
        else:
            row.update(last_status=status)
    cluster.last_status = {"checked_at": timezone.now().isoformat(), "head_ray": answers[head.pk].get("ray"),
                           "agents": {a["machine"]: {k: v for k, v in a.items() if k != "ray"} for a in answers.values()}}
    cluster.last_status_at = timezone.now()
    cluster.save(update_fields=["last_status", "last_status_at"])


def check_slowest() -> int:
    """Seconds a check takes at most: a connect timeout and two agent commands (30 s, 45 s). A check
    still Looking after that was lost with its worker."""
    return settings.FADEN_SSH_CONNECT_TIMEOUT + 75


def beat_confirm_countdown() -> int:
    """When the timer second look of a check a heartbeat started runs, should no heartbeat have
    confirmed it before (its machine stopped beating, say): two beats, and never sooner than a
    scheduled check's second look."""
    return max(settings.FADEN_HEALTH_LOOK_AGAIN, 2 * settings.FADEN_HEARTBEAT_INTERVAL)


def cluster_check_run(*, cluster_id: int, trigger: str, detail: str = "", first_look_id: int | None = None,
                      check_id: int | None = None) -> HealthCheck | None:
    """One check of a running cluster, recorded whatever it finds; a cluster in another state, or with
    an operation under way, is left alone (a manual check says so). ``check_id``: the row a heartbeat
    wrote when it asked for this check (clusters/heartbeats.py), still Looking. A second look runs once:
    not when a check was written after its first look (a heartbeat's second look, a newer first look)."""
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None:
        return None
    check = None
    if check_id is not None:
        check = HealthCheck.objects.filter(pk=check_id, cluster=cluster, outcome=CheckOutcome.RUNNING).first()
        if check is None:
            return None  # answered already: the task ran twice
    elif first_look_id is not None and HealthCheck.objects.filter(cluster=cluster, pk__gt=first_look_id).exists():
        return None
    busy = selectors.cluster_busy(cluster)
    if cluster.state not in CHECKED or busy:
        if trigger == CheckTrigger.MANUAL or check is not None:
            why = f"{busy.title} is under way" if busy else f"the cluster is {cluster.get_state_display()}"
            check = check or HealthCheck(cluster=cluster, trigger=trigger, trigger_detail=detail)
            check.outcome, check.action, check.finished_at = CheckOutcome.SKIPPED, f"Nothing looked at: {why}.", timezone.now()
            check.save()
            checks_changed(cluster)
            return check
        return None
    if check is None:
        check = HealthCheck.objects.create(cluster=cluster, trigger=trigger, trigger_detail=detail, first_look_id=first_look_id)
    members = sorted(cluster.members.select_related("machine").defer("machine__facts").order_by("machine__name"), key=head_first)
    looked, answers = look(cluster, members)
    findings = policy.diagnose(looked)
    if drained := hooks.held_out_of_ray(cluster):  # Ray let a drained node go: not a fault, nothing to repair
        held = {m.pk for m in members if m.machine_id in drained}
        findings = [f for f in findings if not (f.problem == policy.OUT_OF_RAY and f.member_id in held)]
    first = HealthCheck.objects.filter(pk=first_look_id).first() if first_look_id else None
    confirmed = first is not None and policy.seen_twice(findings, ((f["machine"], f["problem"]) for f in first.found))
    exhausted = [m.pk for m in members if m.rejoin_attempts >= settings.FADEN_RESTART_ATTEMPTS]
    beat_by = next((m.machine.name for m in members if m.machine_id == check.beat_machine_id), None)
    decision = policy.decide(findings, answered=policy.anyone_answered(looked), second_look=confirmed,
                             look_again_after=settings.FADEN_HEALTH_LOOK_AGAIN, restart_attempt=cluster.restart_attempt,
                             attempts=settings.FADEN_RESTART_ATTEMPTS, exhausted=exhausted,
                             look_again_when=f"at {beat_by}'s next heartbeat" if beat_by else "")
    check.looked_at = _looked_at(cluster, members, answers)
    check.found = [{"machine": f.machine, "problem": f.problem, "text": f.text} for f in findings]
    check.outcome = decision.outcome
    check.action = decision.action
    with transaction.atomic():
        cluster = Cluster.objects.select_for_update(no_key=True).get(pk=cluster.pk)
        newer = HealthCheck.objects.filter(cluster=cluster, started_at__gt=check.started_at, finished_at__isnull=False)
        if cluster.state not in CHECKED or selectors.cluster_busy(cluster):
            check.outcome, check.action = CheckOutcome.SKIPPED, "Nothing done: another operation started meanwhile."
        elif newer.exists():
            check.outcome, check.action = CheckOutcome.SKIPPED, "Nothing done: a check that started later has already answered."
        else:
            if decision.outcome != policy.UNANSWERED:
                _record_member_states(cluster, members, findings, answers, decision)
                hooks.after_check(cluster, answers)
            _act(cluster, check, decision)
        check.finished_at = timezone.now()
        check.save()
    checks_changed(cluster)
    return check


def _act(cluster: Cluster, check: HealthCheck, decision: policy.Decision) -> None:
    if decision.outcome == policy.ALL_WELL:
        if cluster.state_reason:
            cluster_transition(cluster=cluster, to=cluster.state, reason="")
        return
    if decision.outcome == policy.UNANSWERED:
        return  # nothing is known, so nothing changes: not even the page's words
    if decision.outcome == policy.LOOK_AGAIN:
        cluster_transition(cluster=cluster, to=cluster.state, reason=f"{check.found[0]['text']} {decision.action}")
        # A heartbeat's check waits for that machine's next beat (clusters/heartbeats.py); this timer
        # is its second look only when no beat came.
        countdown = beat_confirm_countdown() if check.beat_machine_id else settings.FADEN_HEALTH_LOOK_AGAIN
        task_enqueue(services.CHECK_TASK, cluster.pk, CheckTrigger.SECOND_LOOK, "", check.pk, countdown=countdown)
        return
    if decision.outcome == policy.WAITING:
        cluster_transition(cluster=cluster, to=cluster.state, reason=decision.action)
        return
    try:
        if decision.restart:
            services.cluster_restart(cluster=cluster, found=check.found[0]["text"])
        else:
            services.cluster_rejoin(cluster=cluster, member_ids=list(decision.rejoin), reason=decision.action)
    except ValidationError as exc:
        check.outcome, check.action = CheckOutcome.SKIPPED, f"No repair: {' '.join(exc.messages)}"


def _looked_at(cluster: Cluster, members: list[ClusterMember], answers: dict[int, dict]) -> list[str]:
    lines = []
    for member in members:
        answer = answers[member.pk]
        name = member.machine.name
        if member.role == Role.HEAD:
            ray = answer.get("ray")
            if ray is not None:
                lines.append(f"Ray on the head {name}: {ray.get('alive_nodes', '?')} live node(s), {ray.get('gpus', '?')} GPUs")
            else:
                lines.append(f"Ray on the head {name}: no answer ({answer.get('ray_error') or answer.get('error') or 'not asked'})")
        if "runtime" in answer:
            ray = answer["runtime"].get("ray") or {}
            lines.append(f"The agent on {name}: runtime {answer['runtime'].get('state')}, Ray {'running' if ray.get('running') else 'not running'}")
        else:
            lines.append(f"The agent on {name}: no answer ({answer.get('error', '')})")
    return lines


def checks_changed(cluster: Cluster) -> None:
    """Tell the cluster's page (its checks) and the clusters list to render again (after commit)."""
    live.push(f"cluster:{cluster.pk}", part="checks")
    live.push("clusters", part=str(cluster.pk))


def clusters_check_due() -> list[int]:
    """Every running cluster with no operation under way gets a check. A second look that never ran
    (its worker died) is run now instead of a first look."""
    queued = []
    slowest = check_slowest()
    lost_after = timezone.now() - timedelta(seconds=settings.FADEN_HEALTH_LOOK_AGAIN + settings.FADEN_HEALTH_INTERVAL + slowest)
    recent = timezone.now() - timedelta(seconds=settings.FADEN_HEALTH_INTERVAL / 2)
    for cluster in Cluster.objects.filter(state__in=CHECKED):
        if selectors.cluster_busy(cluster):
            continue
        latest = cluster.health_checks.first()
        first_look = None
        if latest and latest.outcome == CheckOutcome.RUNNING and latest.started_at > lost_after:
            continue  # still looking
        if latest and latest.trigger != CheckTrigger.SECOND_LOOK and latest.started_at > recent:
            continue  # looked at lately: a second beat, or a check somebody asked for, counts
        if latest and latest.outcome == CheckOutcome.LOOK_AGAIN:
            if latest.started_at > lost_after:
                continue  # its second look is due soon
            first_look = latest.pk
        trigger = CheckTrigger.SECOND_LOOK if first_look else CheckTrigger.SCHEDULE
        task_enqueue(services.CHECK_TASK, cluster.pk, trigger, "", first_look)
        queued.append(cluster.pk)
    return queued
