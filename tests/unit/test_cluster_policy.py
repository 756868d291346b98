"""Pure decisions for a cluster's life once it exists: the state tables, what a check finds, what is
done about it, how restarts count up to Failed, how Delete goes, and who may join a running cluster."""
import os
from collections import deque
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusters import policy
from clusters.choices import (CAN_DELETE, CAN_RETRY, CAN_START, CAN_STOP, CHECK_BADGE, CHECKED, CLUSTER_BADGE,
                              CLUSTER_TRANSITIONS, MEMBER_BADGE, CheckOutcome, ClusterState, MemberState)
from clusters.planning import IN_ANOTHER_CLUSTER, NO_RUNTIME, OTHER_ARCH, Candidate, Iface, ImageBuild
from clusters.policy import (DELETE_AFTER_STOP, DELETE_NOW, HEAD_DOWN, OFFLINE, OUT_OF_RAY, Finding, Look, MemberLook,
                             cluster_address, decide, delete_plan, diagnose, join_check, next_head, restart_failed)

# 100 examples a property in the suite (it shares the host's two cores with the lab's worker);
# FADEN_HYPOTHESIS_EXAMPLES=2000 pytest this file searches deeper, as a run of its own.
MANY = settings(max_examples=int(os.environ.get("FADEN_HYPOTHESIS_EXAMPLES", "100")), deadline=None)
STATES = set(ClusterState)
S = ClusterState


# ------------------------------------------------------------------ the state tables


def test_the_transition_table_has_a_row_for_every_state_and_names_only_real_states():
    assert set(CLUSTER_TRANSITIONS) == STATES
    for source, targets in CLUSTER_TRANSITIONS.items():
        assert targets <= STATES, f"{source} leads to states that do not exist: {targets - STATES}"
        assert source not in targets, f"{source} lists itself; staying put is not a transition"


def test_the_action_groups_and_the_checked_states_name_only_real_states():
    for group in (CAN_STOP, CAN_START, CAN_RETRY, CAN_DELETE, CHECKED):
        assert group and group <= STATES


def reachable_from(state: str) -> set[str]:
    seen, todo = {state}, deque([state])
    while todo:
        for target in CLUSTER_TRANSITIONS[todo.popleft()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("state", sorted(STATES))
def test_every_state_can_reach_deleting_or_is_deleting(state):
    assert state == S.DELETING or S.DELETING in reachable_from(state)


@pytest.mark.parametrize("state", sorted(STATES))
def test_every_state_can_come_back_to_running(state):
    assert S.RUNNING in reachable_from(state)


def test_a_stopped_cluster_only_starts_or_is_deleted():
    assert CLUSTER_TRANSITIONS[S.STOPPED] == {S.STARTING, S.DELETING}


def test_a_deleting_cluster_only_falls_back_to_stop_not_confirmed_when_the_machines_did_not_confirm():
    assert CLUSTER_TRANSITIONS[S.DELETING] == {S.UNCONFIRMED}


def test_a_stop_not_confirmed_offers_only_stop_again_and_delete_never_a_start():
    assert CLUSTER_TRANSITIONS[S.UNCONFIRMED] == {S.STOPPING, S.DELETING}
    assert S.UNCONFIRMED in CAN_STOP and S.UNCONFIRMED not in CAN_START | CAN_RETRY


@pytest.mark.parametrize("state", sorted(CAN_STOP))
def test_every_state_stop_is_offered_in_may_go_to_stopping(state):
    assert S.STOPPING in CLUSTER_TRANSITIONS[state]


@pytest.mark.parametrize("state", sorted(CAN_START | CAN_RETRY))
def test_every_state_start_or_try_again_is_offered_in_may_go_to_starting(state):
    assert S.STARTING in CLUSTER_TRANSITIONS[state]


@pytest.mark.parametrize("state", sorted(CAN_DELETE))
def test_every_state_delete_is_offered_in_may_go_to_deleting(state):
    assert S.DELETING in CLUSTER_TRANSITIONS[state]


def test_stop_is_not_offered_while_the_cluster_stops_is_stopped_or_is_deleted():
    assert not CAN_STOP & {S.STOPPING, S.STOPPED, S.DELETING}


def test_start_is_only_for_a_stopped_cluster_and_delete_for_anything_not_already_deleting():
    assert CAN_START == {S.STOPPED}
    assert CAN_DELETE == STATES - {S.DELETING}


def test_try_again_is_offered_exactly_where_the_cluster_waits_for_a_person_or_a_pause():
    assert CAN_RETRY == {S.WAITING, S.RETRYING, S.FAILED}


def test_only_a_running_cluster_is_health_checked():
    assert CHECKED == {S.RUNNING}


def test_every_state_outcome_and_member_state_has_a_badge():
    assert set(CLUSTER_BADGE) == STATES
    assert set(MEMBER_BADGE) == set(MemberState)
    assert set(CHECK_BADGE) == set(CheckOutcome)


def test_the_policy_speaks_the_names_the_models_store():
    outcomes = {policy.LOOK_AGAIN, policy.REPAIR, policy.WAITING, policy.UNANSWERED, policy.ALL_WELL}
    assert outcomes <= set(CheckOutcome)
    assert {policy.RETRYING, policy.FAILED} <= STATES


# ------------------------------------------------------------------ diagnose

HEAD = MemberLook(member_id=1, name="gpu-a", is_head=True, ray_running=True, in_ray=True)
WORKER = MemberLook(member_id=2, name="gpu-b", is_head=False, ray_running=True, in_ray=True)
OTHER_WORKER = MemberLook(member_id=3, name="gpu-c", is_head=False, ray_running=True, in_ray=True)


def with_(member: MemberLook, **changes) -> MemberLook:
    return replace(member, **changes)


def test_a_healthy_look_finds_nothing():
    assert diagnose(Look(members=(HEAD, WORKER, OTHER_WORKER))) == []


@pytest.mark.parametrize(
    ("head", "look", "text"),
    [
        (with_(HEAD, machine_state="offline", machine_reason="No heartbeat for 30 s.", answered=False, error="offline",
               ray_running=None, in_ray=None),
         {"head_answered": False, "head_error": "offline"},
         "The head gpu-a is offline (No heartbeat for 30 s)."),
        (with_(HEAD, answered=False, error="Could not reach 198.18.0.11 port 22", ray_running=None, in_ray=None),
         {"head_answered": False, "head_error": "Could not reach 198.18.0.11 port 22"},
         "The head gpu-a does not answer: Could not reach 198.18.0.11 port 22."),
        (with_(HEAD, ray_running=False, in_ray=None), {"head_answered": False, "head_error": "no GCS"},
         "Ray is not running on the head gpu-a."),
        (with_(HEAD, in_ray=None), {"head_answered": False, "head_error": "ray status timed out after 45 s."},
         "Ray on the head gpu-a does not answer: ray status timed out after 45 s."),
    ],
    ids=["machine offline", "agent silent", "ray not running", "ray not answering"],
)
def test_a_head_that_stopped_in_any_way_is_found_down_with_what_stopped(head, look, text):
    worker = with_(WORKER, in_ray=None)

    findings = diagnose(Look(members=(worker, head), **look))

    assert findings[0] == Finding(1, "gpu-a", HEAD_DOWN, text)
    assert [f.problem for f in findings] == [HEAD_DOWN]


def test_a_worker_whose_machine_went_offline_is_found_offline_with_the_reason():
    worker = with_(WORKER, machine_state="offline", machine_reason="No heartbeat for 30 s", answered=False,
                   error="offline", ray_running=None, in_ray=False)

    assert diagnose(Look(members=(HEAD, worker))) == [Finding(2, "gpu-b", OFFLINE, "gpu-b is offline (No heartbeat for 30 s).")]


def test_a_worker_without_ray_running_is_out_of_ray():
    worker = with_(WORKER, ray_running=False, in_ray=False)

    assert diagnose(Look(members=(HEAD, worker))) == [Finding(2, "gpu-b", OUT_OF_RAY, "Ray is not running on gpu-b.")]


def test_a_worker_the_node_list_does_not_hold_as_alive_is_out_of_ray():
    worker = with_(WORKER, in_ray=False)

    assert diagnose(Look(members=(HEAD, worker))) == [
        Finding(2, "gpu-b", OUT_OF_RAY, "Ray's node list does not hold gpu-b as alive.")
    ]


def test_a_silent_worker_missing_from_the_node_list_says_its_agent_does_not_answer_either():
    worker = with_(WORKER, answered=False, error="timed out.", ray_running=None, in_ray=False)

    (finding,) = diagnose(Look(members=(HEAD, worker)))

    assert finding.problem == OUT_OF_RAY
    assert finding.text == "Ray's node list does not hold gpu-b as alive and its agent does not answer (timed out)."


def member_looks():
    """A head and up to four workers, each in any state a check can see."""
    machine = st.sampled_from(["healthy", "offline"])
    tristate = st.sampled_from([True, False, None])
    look = st.builds(
        lambda state, answered, running, in_ray: dict(machine_state=state, answered=answered, ray_running=running, in_ray=in_ray),
        machine, st.booleans(), tristate, tristate,
    )
    return st.lists(look, min_size=1, max_size=5).map(
        lambda looks: tuple(
            MemberLook(member_id=i + 1, name=f"gpu-{chr(97 + i)}", is_head=i == 0, error="no answer", **fields)
            for i, fields in enumerate(looks)
        )
    )


looks = st.builds(lambda members, head_answered, reverse: Look(members=members[::-1] if reverse else members,
                                                               head_answered=head_answered, head_error="no answer"),
                  member_looks(), st.booleans(), st.booleans())


@MANY
@given(looks)
def test_diagnose_reports_the_head_first_and_each_member_at_most_once(look):
    findings = diagnose(look)

    ids = [f.member_id for f in findings]
    assert len(ids) == len(set(ids))
    heads = [f for f in findings if f.problem == HEAD_DOWN]
    assert heads == [f for f in findings if f.member_id == 1]
    if heads:
        assert findings[0] is heads[0]


# ------------------------------------------------------------------ decide


def head_down(text="Ray is not running on the head gpu-a."):
    return Finding(1, "gpu-a", HEAD_DOWN, text)


def offline(member_id=2, name="gpu-b"):
    return Finding(member_id, name, OFFLINE, f"{name} is offline.")


def out_of_ray(member_id=3, name="gpu-c"):
    return Finding(member_id, name, OUT_OF_RAY, f"Ray is not running on {name}.")


def test_a_check_nobody_answered_restarts_nothing_even_with_the_head_down_on_a_second_look():
    decision = decide([head_down()], answered=False, second_look=True, look_again_after=20)

    assert decision.outcome == policy.UNANSWERED
    assert not decision.restart and decision.rejoin == ()
    assert "nothing was restarted" in decision.action


def test_a_healthy_cluster_is_left_alone():
    decision = decide([], answered=True, second_look=False, look_again_after=20)

    assert decision.outcome == policy.ALL_WELL
    assert not decision.restart and decision.rejoin == ()


@pytest.mark.parametrize("finding", [head_down(), out_of_ray()], ids=["head down", "worker out of Ray"])
def test_a_problem_on_the_first_look_is_looked_at_again_after_the_wait_before_any_repair(finding):
    decision = decide([finding], answered=True, second_look=False, look_again_after=20)

    assert decision.outcome == policy.LOOK_AGAIN
    assert "Looking again in 20 s" in decision.action
    assert not decision.restart and decision.rejoin == ()


def test_a_head_still_down_on_the_second_look_restarts_the_cluster_as_attempt_1_of_3():
    decision = decide([head_down()], answered=True, second_look=True, look_again_after=20)

    assert decision.outcome == policy.REPAIR
    assert decision.restart is True and decision.rejoin == ()
    assert decision.action == "Restarting the cluster (attempt 1 of 3): Ray is not running on the head gpu-a."


def test_the_restart_a_check_decides_counts_on_from_the_restarts_already_made():
    decision = decide([head_down()], answered=True, second_look=True, look_again_after=20, restart_attempt=1, attempts=3)

    assert decision.action.startswith("Restarting the cluster (attempt 2 of 3)")


@pytest.mark.parametrize("second_look", [False, True])
def test_an_offline_worker_means_waiting_for_it_by_name_with_no_repair_even_with_another_worker_out_of_ray(second_look):
    decision = decide([offline(), out_of_ray()], answered=True, second_look=second_look, look_again_after=20)

    assert decision.outcome == policy.WAITING
    assert decision.waiting_for == ("gpu-b",)
    assert decision.action == "No repair while a machine is offline: waiting until gpu-b reconnects."
    assert not decision.restart and decision.rejoin == ()


def test_waiting_for_several_offline_machines_names_them_all():
    decision = decide([offline(2, "gpu-b"), offline(3, "gpu-c"), offline(4, "gpu-d")], answered=True, second_look=True,
                      look_again_after=20)

    assert decision.waiting_for == ("gpu-b", "gpu-c", "gpu-d")
    assert decision.action.endswith("waiting until gpu-b, gpu-c and gpu-d reconnect.")


def test_a_worker_still_out_of_ray_on_the_second_look_joins_again_by_its_member_id():
    decision = decide([out_of_ray(3, "gpu-c")], answered=True, second_look=True, look_again_after=20)

    assert decision.outcome == policy.REPAIR
    assert decision.rejoin == (3,)
    assert not decision.restart
    assert decision.action.startswith("Taking gpu-c out of Ray and joining it again")


findings = st.lists(
    st.builds(lambda problem, i: Finding(i, f"gpu-{i}", problem, "text."),
              st.sampled_from([HEAD_DOWN, OFFLINE, OUT_OF_RAY]), st.integers(1, 6)),
    max_size=6,
)


@MANY
@given(findings, st.booleans(), st.integers(0, 5))
def test_decide_never_repairs_when_nobody_answered(found, second_look, restart_attempt):
    decision = decide(found, answered=False, second_look=second_look, look_again_after=20, restart_attempt=restart_attempt)

    assert decision.outcome == policy.UNANSWERED
    assert not decision.restart and decision.rejoin == ()


@MANY
@given(findings, st.integers(0, 5))
def test_decide_never_repairs_without_a_second_look(found, restart_attempt):
    decision = decide(found, answered=True, second_look=False, look_again_after=20, restart_attempt=restart_attempt)

    assert decision.outcome != policy.REPAIR
    assert not decision.restart and decision.rejoin == ()


@MANY
@given(findings, st.booleans())
def test_decide_never_rejoins_a_worker_while_a_machine_is_offline(found, second_look):
    decision = decide(found, answered=True, second_look=second_look, look_again_after=20)

    if any(f.problem == OFFLINE for f in found):
        assert decision.rejoin == ()
    assert decision.restart == (second_look and any(f.problem == HEAD_DOWN for f in found))
    if decision.restart or decision.rejoin:
        assert decision.outcome == policy.REPAIR


@MANY
@given(looks, st.booleans())
def test_what_a_check_sees_never_leads_to_a_repair_on_a_first_look_or_to_a_rejoin_while_a_machine_is_offline(
        look, second_look):
    decision = decide(diagnose(look), answered=policy.anyone_answered(look), second_look=second_look, look_again_after=20)

    if not second_look:
        assert decision.outcome != policy.REPAIR
    offline_ids = {m.member_id for m in look.members if m.machine_state == "offline"}
    if decision.rejoin:
        assert 1 not in decision.rejoin
        assert not offline_ids


# ------------------------------------------------------------------ restarts, then Failed


def test_the_first_failed_restart_retries_after_the_first_pause_as_attempt_2_of_3():
    outcome = restart_failed("Ray did not start on gpu-a", attempt=1, attempts=3, first_pause=30, failed_retry=900)

    assert (outcome.state, outcome.pause) == (policy.RETRYING, 30)
    assert outcome.reason == ("Restart 1 of 3 failed: Ray did not start on gpu-a. "
                              "Restarting the cluster (attempt 2 of 3) in 30 s.")


def test_the_second_failed_restart_retries_after_twice_the_first_pause_as_attempt_3_of_3():
    outcome = restart_failed("Ray did not start on gpu-a.", attempt=2, attempts=3, first_pause=30, failed_retry=900)

    assert (outcome.state, outcome.pause) == (policy.RETRYING, 60)
    assert "Restarting the cluster (attempt 3 of 3) in 60 s." in outcome.reason


def test_the_last_failed_restart_reads_failed_and_tries_again_every_15_minutes():
    outcome = restart_failed("Ray did not start on gpu-a", attempt=3, attempts=3, first_pause=30, failed_retry=900)

    assert (outcome.state, outcome.pause) == (policy.FAILED, 900)
    assert "did not come back after 3 restarts: Ray did not start on gpu-a." in outcome.reason
    assert "every 15 minutes" in outcome.reason
    assert "select Try again" in outcome.reason


def test_a_failed_retry_that_is_not_whole_minutes_is_said_in_seconds():
    assert "every 90 s" in restart_failed("x", attempt=3, attempts=3, first_pause=30, failed_retry=90).reason


@MANY
@given(st.integers(1, 8), st.integers(1, 600), st.integers(60, 3600))
def test_restart_pauses_double_and_the_last_attempt_always_reads_failed(attempts, first_pause, failed_retry):
    outcomes = [restart_failed("Ray did not start.", attempt=n, attempts=attempts, first_pause=first_pause,
                               failed_retry=failed_retry) for n in range(1, attempts + 1)]

    *retries, last = outcomes
    assert [o.state for o in retries] == [policy.RETRYING] * (attempts - 1)
    assert [o.pause for o in retries] == [first_pause * 2 ** n for n in range(attempts - 1)]
    assert all(f"(attempt {n + 1} of {attempts})" in o.reason for n, o in enumerate(retries, start=1))
    assert last.state == policy.FAILED
    assert last.pause == failed_retry
    assert "Try again" in last.reason


@MANY
@given(st.integers(1, 5), st.integers(0, 5))
def test_an_attempt_past_the_last_still_reads_failed(attempts, beyond):
    outcome = restart_failed("x", attempt=attempts + beyond, attempts=attempts, first_pause=30, failed_retry=900)

    assert outcome.state == policy.FAILED


# ------------------------------------------------------------------ delete


@pytest.mark.parametrize(
    "situation",
    [
        dict(members=0, machines_online=0),
        dict(members=2, machines_online=0),
    ],
    ids=["no members", "all machines offline"],
)
def test_delete_goes_at_once_when_no_machine_of_the_cluster_can_answer(situation):
    assert delete_plan(**situation) == DELETE_NOW


def test_delete_of_a_cluster_with_a_machine_that_answers_is_a_job_running_or_stopped():
    # A stopped cluster's machines still hold its node settings (hostfile, the cluster's own SSH, /shared).
    assert delete_plan(members=2, machines_online=1) == DELETE_AFTER_STOP


# ------------------------------------------------------------------ join a running cluster

NETWORK = "198.18.1.0/24"
BUILDS = (
    ImageBuild(id="nv-x86", arch="x86_64", accelerator_vendor="nvidia", version="2.1.0"),
    ImageBuild(id="nv-arm", arch="aarch64", accelerator_vendor="nvidia", version="2.1.0"),
)


def machine(host: int, name: str, *, fabric=True, count=8, **fields) -> Candidate:
    interfaces = [Iface("eth0", (f"198.18.0.{host}/24",), default_route=True)]
    if fabric:
        interfaces.append(Iface("eth1", (f"198.18.1.{host}/24",)))
    fields = {"arch": "x86_64", "accelerator_vendor": "nvidia", "accelerator_model": "NVIDIA H100 80GB HBM3",
              "container_runtime": "docker", **fields}
    return Candidate(id=host, name=name, accelerator_count=count, interfaces=tuple(interfaces),
                     ssh_address=f"198.18.0.{host}", **fields)


GPU_A = machine(11, "gpu-a", cluster_name="gpu-room")  # the head
GPU_B = machine(12, "gpu-b", cluster_name="gpu-room")
TAKEN = machine(13, "gpu-c", cluster_name="other-room")
OFFLINE_ONE = machine(14, "gpu-d", state="offline", state_label="Offline", state_reason="No heartbeat for 30 s")
AMD = machine(15, "gpu-e", accelerator_vendor="amd", accelerator_model="AMD Instinct MI300X")
NO_FABRIC = machine(16, "gpu-f", fabric=False)
ARM = machine(17, "gpu-g", arch="aarch64", accelerator_model="NVIDIA GH200 96GB", count=4)
FREE = machine(18, "gpu-h")
EVERYONE = [GPU_A, GPU_B, TAKEN, OFFLINE_ONE, AMD, NO_FABRIC, ARM, FREE]


@pytest.fixture
def verdicts():
    return join_check(EVERYONE, BUILDS, head_id=GPU_A.id, network=NETWORK, members=[GPU_A.id, GPU_B.id])


def test_machines_already_in_the_cluster_are_left_out_of_the_join_verdicts(verdicts):
    assert set(verdicts) == {c.id for c in EVERYONE} - {GPU_A.id, GPU_B.id}


@pytest.mark.parametrize(
    ("candidate", "refusal"),
    [
        (TAKEN, IN_ANOTHER_CLUSTER.format(name="gpu-c", cluster="other-room")),
        (OFFLINE_ONE, "gpu-d is Offline: No heartbeat for 30 s."),
        (AMD, f"{NO_RUNTIME}gpu-e (AMD Instinct MI300X, x86_64)."),
        (NO_FABRIC, "gpu-f has no address on the cluster's network 198.18.1.0/24."),
    ],
    ids=["in another cluster", "offline", "no runtime", "not on the network"],
)
def test_a_machine_that_cannot_join_is_refused_in_words(verdicts, candidate, refusal):
    verdict = verdicts[candidate.id]
    assert not verdict.selectable
    assert verdict.refusal == refusal


def test_a_machine_of_another_architecture_may_join_with_a_warning_and_its_own_runtime(verdicts):
    verdict = verdicts[ARM.id]

    assert verdict.selectable and verdict.refusal == ""
    assert verdict.warning == OTHER_ARCH.format(name="gpu-g", arch="aarch64", head_arch="x86_64")
    assert verdict.runtime == BUILDS[1]


def test_a_free_healthy_machine_on_the_network_may_join_without_a_warning(verdicts):
    verdict = verdicts[FREE.id]

    assert verdict.selectable and verdict.warning == "" and verdict.runtime == BUILDS[0]


def test_each_verdict_carries_the_address_the_machine_would_join_with_or_none(verdicts):
    assert verdicts[FREE.id].address == "198.18.1.18"
    assert verdicts[TAKEN.id].address == "198.18.1.13"  # refused for another reason, its address all the same
    assert verdicts[NO_FABRIC.id].address is None


def test_the_address_a_machine_joins_with_is_its_address_on_the_cluster_network_without_the_prefix():
    assert cluster_address(FREE, NETWORK) == "198.18.1.18"
    assert cluster_address(FREE, "198.18.0.0/24") == "198.18.0.18"
    assert cluster_address(NO_FABRIC, NETWORK) is None


def test_the_machine_with_the_most_accelerators_leads_once_the_head_left_and_the_first_by_name_among_equals():
    assert next_head([ARM, FREE, GPU_B]) == GPU_B.id
    assert next_head([ARM]) == ARM.id
    assert next_head([]) is None


def test_a_second_look_confirms_only_problems_the_first_look_found_on_the_same_machine():
    out = Finding(2, "lab-b", OUT_OF_RAY, "Ray is not running on lab-b.")
    head = Finding(1, "lab-a", HEAD_DOWN, "Ray is not running on the head lab-a.")

    assert policy.seen_twice([out], [("lab-b", OUT_OF_RAY)])
    assert not policy.seen_twice([out, head], [("lab-b", OUT_OF_RAY)])
    assert not policy.seen_twice([out], [("lab-c", OUT_OF_RAY)])


def test_the_failed_retry_is_said_in_whole_minutes_or_in_seconds():
    assert policy.every(900) == "15 minutes" and policy.every(90) == "90 s" and policy.every(60) == "60 s"


def test_a_silent_worker_that_ray_still_lists_is_said_and_waited_for_but_not_repaired():
    look = Look(members=(MemberLook(1, "lab-a", True, in_ray=True, ray_running=True),
                         MemberLook(2, "lab-c", False, answered=False, error="port 22 did not answer within 10 s.", in_ray=True)))

    findings = policy.diagnose(look)
    decision = policy.decide(findings, answered=True, second_look=True, look_again_after=20)

    assert [(f.machine, f.problem) for f in findings] == [("lab-c", policy.NO_ANSWER)]
    assert "lab-c does not answer (port 22 did not answer within 10 s); Ray still lists it." == findings[0].text
    assert decision.outcome == policy.WAITING and not decision.rejoin and not decision.restart
    assert "Nothing to repair while Ray still lists lab-c" in decision.action
