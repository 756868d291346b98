"""A cluster's page and its buttons, through the Django test client: what is offered in each state,
what each button calls, and what the live pushes carry."""
import re

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from clusters import actions, pages, services
from clusters.choices import CheckOutcome, CheckTrigger, ClusterState, Role
from clusters.models import Cluster, HealthCheck, NetworkMeasurement, RuntimeImage
from console import roles
from console.models import Job
from machines.choices import MachineState
from machines.models import Machine
from tests.builders import cluster_of, deployment_of, gpu_machine
from tests.factories import MachineFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def build():
    return RuntimeImage.objects.create(name="NVIDIA x86_64 Runtime", version="2.1.0", digest="sha256:" + "ab" * 32,
                                       size_bytes=1024, arch="x86_64", accelerator_vendor="nvidia", path="/images/a.img")


def make_cluster(build, name="gpu-room", state=ClusterState.RUNNING, hosts=(11, 12, 13), reason=""):
    return cluster_of([gpu_machine(f"{name}-{host}", host) for host in hosts], state=state, name=name, runtime=build,
                      state_reason=reason)


def machine_of(cluster, index):
    return sorted(cluster.members.select_related("machine"), key=lambda m: m.machine.name)[index].machine


def button(html: str, label: str) -> str:
    """The <button> (or link) whose text is ``label``, as HTML: to check whether it is disabled."""
    match = re.search(r"<(button|a)\b[^>]*>\s*" + re.escape(label) + r"\s*</\1>", html)
    assert match, f"no {label!r} button on the page"
    return match.group(0)


def page(client, cluster, query=""):
    response = client.get(f"/clusters/{cluster.pk}/{query}")
    assert response.status_code == 200
    return response.content.decode()


# -- what each state offers ----------------------------------------------------------------------


def test_a_running_cluster_offers_check_now_stop_and_add_machines_but_not_start(admin_client, build):
    html = page(admin_client, make_cluster(build))
    assert "disabled" not in button(html, "Check now")
    assert "data-dialog-open=\"stop-dialog\"" in button(html, "Stop")
    assert "disabled" not in button(html, "Add machines")
    assert ">Start<" not in html
    assert ">Try again<" not in html


def test_a_stopped_cluster_offers_start_and_neither_stop_nor_check_now(admin_client, build):
    html = page(admin_client, make_cluster(build, state=ClusterState.STOPPED))
    assert "disabled" not in button(html, "Start")
    assert ">Stop<" not in html
    assert ">Check now<" not in html
    assert "disabled" in button(html, "Add machines")
    assert "Machines join a running cluster; gpu-room is Stopped." in html


def test_a_failed_cluster_offers_try_again_and_says_it_is_tried_again_every_15_minutes(admin_client, build):
    cluster = make_cluster(build, state=ClusterState.FAILED, reason="Restart 3 of 3 failed: the head did not answer.")
    html = page(admin_client, cluster)
    assert "disabled" not in button(html, "Try again")
    assert "tried again every 15 minutes" in html
    assert "Restart 3 of 3 failed: the head did not answer." in html


def test_a_running_cluster_with_a_reason_shows_it_as_a_warning(admin_client, build):
    html = page(admin_client, make_cluster(build, reason="No repair while a machine is offline: waiting until lab-c reconnects."))
    assert re.search(r'callout--warn"><p>No repair while a machine is offline', html)


@pytest.mark.parametrize("state", list(ClusterState))
def test_the_page_renders_in_every_state_with_its_badge(admin_client, build, state):
    cluster = make_cluster(build, state=state, hosts=(11,))
    html = page(admin_client, cluster)
    assert cluster.get_state_display() in html


def test_deploy_a_model_leads_to_the_form_on_a_running_cluster_and_says_why_not_on_a_stopped_one(admin_client, build):
    cluster = make_cluster(build)
    assert f'href="/deployments/new/?cluster={cluster.pk}">Deploy a model</a>' in page(admin_client, cluster)
    cluster.state = ClusterState.STOPPED
    cluster.save()
    html = page(admin_client, cluster)
    assert "disabled" in button(html, "Deploy a model")
    assert "models are deployed on a running cluster" in html


def test_a_busy_cluster_disables_its_buttons_and_names_the_operation_under_way(admin_client, build):
    cluster = make_cluster(build)
    Job.objects.create(kind="cluster.stop", title="Stop gpu-room", target_type="cluster", target_id=cluster.pk, state="running")
    html = page(admin_client, cluster)
    assert "disabled" in button(html, "Stop")
    assert "disabled" in button(html, "Add machines")
    assert "gpu-room is busy: Stop gpu-room is running. Add machines once it has finished." in html


def test_stop_stays_offered_while_machines_join_because_it_wins_over_them(admin_client, build):
    cluster = make_cluster(build)
    Job.objects.create(kind="cluster.add", title="Add lab-d to gpu-room", target_type="cluster", target_id=cluster.pk, state="running")
    html = page(admin_client, cluster)
    assert "disabled" not in button(html, "Stop")
    assert "disabled" in button(html, "Add machines")


# -- what the buttons do --------------------------------------------------------------------------


@pytest.fixture
def calls(monkeypatch):
    """Replace the services the buttons call by recorders: the tasks behind them would reach machines."""
    made = []

    def recorder(name):
        def call(**kwargs):
            made.append((name, kwargs))
            return Job(title=f"{name} job")
        return call

    for name in ("cluster_stop", "cluster_start", "cluster_check_now", "cluster_add_machines", "cluster_switch_runtime"):
        monkeypatch.setattr(services, name, recorder(name))
    return made


def test_stop_calls_the_service_and_returns_to_the_cluster(admin_client, build, calls):
    cluster = make_cluster(build)
    response = admin_client.post(f"/clusters/{cluster.pk}/stop/", follow=True)
    assert calls[0][0] == "cluster_stop" and calls[0][1]["cluster"].pk == cluster.pk
    assert response.redirect_chain[-1][0] == f"/clusters/{cluster.pk}/"
    assert "Stopping gpu-room" in response.content.decode()


def test_check_now_calls_the_service(admin_client, build, calls):
    cluster = make_cluster(build)
    response = admin_client.post(f"/clusters/{cluster.pk}/check/", follow=True)
    assert [name for name, _ in calls] == ["cluster_check_now"]
    assert "Looking at gpu-room now" in response.content.decode()


def test_start_calls_the_service_on_a_stopped_cluster(admin_client, build, calls):
    cluster = make_cluster(build, state=ClusterState.STOPPED)
    admin_client.post(f"/clusters/{cluster.pk}/start/")
    assert [name for name, _ in calls] == ["cluster_start"]


def test_start_on_a_running_cluster_shows_the_services_refusal(admin_client, build):
    cluster = make_cluster(build)
    response = admin_client.post(f"/clusters/{cluster.pk}/start/", follow=True)
    assert "gpu-room is Running: Start is for a stopped cluster." in response.content.decode()
    cluster.refresh_from_db()
    assert cluster.state == ClusterState.RUNNING


def test_a_refused_stop_shows_the_services_message(admin_client, build, monkeypatch):
    cluster = make_cluster(build)

    def refuse(**kwargs):
        raise ValidationError("gpu-room is busy: Start gpu-room is running. Stop it once it has finished.")

    monkeypatch.setattr(services, "cluster_stop", refuse)
    response = admin_client.post(f"/clusters/{cluster.pk}/stop/", follow=True)
    assert "gpu-room is busy: Start gpu-room is running. Stop it once it has finished." in response.content.decode()


def test_the_buttons_only_answer_a_post(admin_client, build, calls):
    cluster = make_cluster(build)
    for action in ("stop", "start", "check", "network/test"):
        assert admin_client.get(f"/clusters/{cluster.pk}/{action}/").status_code == 405
    assert calls == []


def test_the_delete_page_says_a_running_cluster_is_stopped_first_and_its_machines_stay_enrolled(admin_client, build):
    cluster = make_cluster(build)
    html = admin_client.get(f"/clusters/{cluster.pk}/delete/").content.decode()
    assert "stopped first" in html
    assert "stay enrolled" in html
    assert "disabled" not in button(html, "Delete gpu-room")


def test_deleting_a_stopped_cluster_of_offline_machines_removes_it_at_once_and_returns_to_the_list(admin_client, build):
    cluster = make_cluster(build, state=ClusterState.STOPPED)
    Machine.objects.update(state=MachineState.OFFLINE)
    response = admin_client.post(f"/clusters/{cluster.pk}/delete/", follow=True)
    assert response.redirect_chain[-1][0] == "/clusters/"
    assert "gpu-room was deleted" in response.content.decode()
    assert not Cluster.objects.filter(pk=cluster.pk).exists()


def test_a_cluster_with_deployments_is_not_deleted_and_the_page_says_why(admin_client, build):
    cluster = make_cluster(build, state=ClusterState.STOPPED)
    deployment_of(cluster)
    page = admin_client.get(f"/clusters/{cluster.pk}/delete/").content.decode()
    assert "disabled" in button(page, "Delete gpu-room")
    # The sentence is the delete offer's own (the deployments' extension refuses it), not a count the page makes.
    assert "gpu-room still has 1 deployment: delete them first, so that no model is left running on the machines." in page
    response = admin_client.post(f"/clusters/{cluster.pk}/delete/", follow=True)
    assert "delete them first" in response.content.decode()
    assert Cluster.objects.filter(pk=cluster.pk).exists()


# -- add machines ---------------------------------------------------------------------------------


def test_the_add_page_lists_refusals_and_disables_their_checkboxes(admin_client, build):
    cluster = make_cluster(build)
    free = gpu_machine("lab-d", 14)
    amd = gpu_machine("lab-e", 15, vendor="amd", model="AMD Instinct MI300X")
    elsewhere = gpu_machine("lab-f", 16, cluster_network=False)
    html = admin_client.get(f"/clusters/{cluster.pk}/add/").content.decode()

    def checkbox(machine):
        return re.search(rf'<input type="checkbox" name="machines" value="{machine.pk}"[^>]*>', html).group(0)

    assert "disabled" not in checkbox(free)
    assert "disabled" in checkbox(amd)
    assert "No certified runtime image runs on lab-e" in html
    assert "disabled" in checkbox(elsewhere)
    assert "lab-f has no address on the cluster&#x27;s network 198.18.1.0/24." in html
    assert "runs NVIDIA x86_64 Runtime 2.x" in html


def test_another_architecture_is_a_warning_not_a_refusal(admin_client, build):
    RuntimeImage.objects.create(name="NVIDIA aarch64 Runtime", version="2.1.0", digest="sha256:" + "cd" * 32, size_bytes=1024,
                                arch="aarch64", accelerator_vendor="nvidia", path="/images/b.img")
    cluster = make_cluster(build)
    arm = gpu_machine("lab-g", 17, arch="aarch64", model="NVIDIA GH200 480GB")
    html = admin_client.get(f"/clusters/{cluster.pk}/add/").content.decode()
    assert "another architecture" in html
    assert "disabled" not in re.search(rf'<input type="checkbox" name="machines" value="{arm.pk}"[^>]*>', html).group(0)


def test_adding_machines_calls_the_service_with_the_ticked_machines_and_returns_to_the_cluster(admin_client, build, calls):
    cluster = make_cluster(build)
    free = gpu_machine("lab-d", 14)
    response = admin_client.post(f"/clusters/{cluster.pk}/add/", {"machines": [str(free.pk)]})
    assert response.status_code == 302 and response.url == f"/clusters/{cluster.pk}/"
    assert calls == [("cluster_add_machines", {"cluster": cluster, "machine_ids": [free.pk], "user": calls[0][1]["user"]})]


def test_adding_nothing_shows_the_services_message_on_the_page(admin_client, build):
    cluster = make_cluster(build)
    response = admin_client.post(f"/clusters/{cluster.pk}/add/", {})
    assert response.status_code == 400
    assert "Tick at least one machine to add." in response.content.decode()


# -- the machine panel and the diagram --------------------------------------------------------------


def test_the_machine_panel_of_a_running_cluster_opens_the_drain_plan_and_refuses_the_head_with_the_reason(admin_client, build):
    cluster = make_cluster(build)
    head, worker = machine_of(cluster, 0), machine_of(cluster, 1)
    html = page(admin_client, cluster, f"?machine={worker.pk}")
    panel = re.search(rf'<div class="machine-panel" id="machine-panel-{worker.pk}"[^>]*>.*?</ul>', html, re.S).group(0)
    assert " hidden" not in panel.split(">")[0]
    # A worker of a running cluster leaves by a drain: Drain and Remove from cluster open its drain plan.
    assert f'href="/deployments/drain/plan/?machines={worker.pk}"' in panel
    assert f'href="/deployments/drain/plan/?machines={worker.pk}&amp;remove=1"' in panel
    assert "not available yet" not in html
    assert "comes with deployments" not in html  # the words of before deployments existed
    head_panel = re.search(rf'<div class="machine-panel" id="machine-panel-{head.pk}"[^>]*>.*?</ul>', html, re.S).group(0)
    assert "to take out the head, stop the cluster first." in head_panel
    assert f"{head.name} leads gpu-room: the cluster cannot run without it. Stop the cluster instead, or drain the other " \
           "machines." in head_panel and "disabled" in button(head_panel, "Drain")
    assert " hidden" in head_panel.split(">")[0]


def test_the_machine_panel_shows_what_the_machine_runs(admin_client, build):
    cluster = make_cluster(build)
    member = cluster.members.get(role=Role.HEAD)
    member.last_status = {"runtime": {"driver": "podman", "state": "running", "digest": build.digest,
                                      "ray": {"running": True, "role": "head", "gcs_address": "198.18.1.11:6379"}},
                          "ray_node": {"node_id": "f00dfeed", "address": "198.18.1.11", "alive": True, "gpus": 8}}
    member.save()
    html = page(admin_client, cluster, f"?machine={member.machine_id}")
    assert "podman" in html and "abababababab" in html
    assert "f00dfeed" in html
    assert ">alive<" in html and "8 GPUs" in html


def test_on_a_stopped_cluster_a_machine_can_be_removed(admin_client, build):
    cluster = make_cluster(build, state=ClusterState.STOPPED)
    worker = machine_of(cluster, 1)
    html = page(admin_client, cluster, f"?machine={worker.pk}")
    assert f'formaction="/clusters/{cluster.pk}/machines/{worker.pk}/remove/"' in html
    response = admin_client.post(f"/clusters/{cluster.pk}/machines/{worker.pk}/remove/", follow=True)
    assert f"{worker.name} left gpu-room" in response.content.decode()
    assert not cluster.members.filter(machine=worker).exists()


def test_removing_a_machine_from_a_running_cluster_shows_the_services_refusal(admin_client, build):
    cluster = make_cluster(build)
    head = machine_of(cluster, 0)
    response = admin_client.post(f"/clusters/{cluster.pk}/machines/{head.pk}/remove/", follow=True)
    assert "to take out the head, stop the cluster first." in response.content.decode()
    assert cluster.members.filter(machine=head).exists()


def test_the_diagram_shows_the_measured_mbit_s_from_the_head_and_not_measured_otherwise(admin_client, build):
    cluster = make_cluster(build)
    head, measured, unmeasured = machine_of(cluster, 0), machine_of(cluster, 1), machine_of(cluster, 2)
    NetworkMeasurement.objects.create(subnet="198.18.1.0/24", source=head, target=measured, mbps=94120.4)
    NetworkMeasurement.objects.create(subnet="198.18.0.0/24", source=head, target=unmeasured, mbps=9400)  # another network
    html = page(admin_client, cluster)
    svg = re.search(r"<svg class=\"wire\".*?</svg>", html, re.S).group(0)
    assert "94,120 Mbit/s" in svg
    assert svg.count("not measured") == 1
    assert "198.18.1.0/24" in svg
    for machine in (head, measured, unmeasured):
        assert machine.name in svg and f'data-select-machine="{machine.pk}"' in svg


def test_the_diagram_stays_within_reach_for_twenty_machines(build):
    cluster = make_cluster(build, hosts=range(20, 40))
    cards = pages.cluster_cards(cluster, role=roles.OPERATOR)
    diagram = pages.wiring_card(cluster, cards)["diagram"]
    assert len(diagram["nodes"]) == 19 and diagram["compact"]
    assert diagram["height"] < 1200
    tops = [n["y"] for n in diagram["nodes"]]
    assert all(b - a >= n["h"] for a, b, n in zip(tops, tops[1:], diagram["nodes"]))  # no box overlaps the next


# -- the cards under it ---------------------------------------------------------------------------


def test_health_checks_and_the_raw_status_are_listed_under_advanced(admin_client, build):
    cluster = make_cluster(build)
    cluster.last_status = {"ray": {"alive": 3}}
    cluster.last_status_at = timezone.now()
    cluster.save()
    HealthCheck.objects.create(cluster=cluster, trigger=CheckTrigger.RECONNECT, trigger_detail="lab-b", outcome=CheckOutcome.REPAIR,
                               looked_at=["Ray on the head"], found=[{"machine": "lab-c", "problem": "out_of_ray", "text": "Ray lists lab-c as dead."}],
                               action="Joining lab-c again.")
    html = page(admin_client, cluster)
    assert "A machine reconnected" in html and "lab-b" in html
    assert "Ray lists lab-c as dead." in html and "Joining lab-c again." in html
    assert "badge--amber\">Repairing" in html
    assert "&quot;alive&quot;: 3" in html


def test_the_runtime_card_offers_a_newer_build_and_the_switch_says_it_restarts_the_cluster(admin_client, build, calls):
    cluster = make_cluster(build)
    RuntimeImage.objects.create(name="NVIDIA x86_64 Runtime", version="2.2.0", digest="sha256:" + "ef" * 32, size_bytes=1024,
                                arch="x86_64", accelerator_vendor="nvidia", path="/images/c.img")
    assert "A newer certified build is available: 2.2.0" in page(admin_client, cluster)
    confirm = admin_client.get(f"/clusters/{cluster.pk}/runtime/switch/").content.decode()
    assert "Switching restarts the cluster and every model on it on the new build." in confirm
    admin_client.post(f"/clusters/{cluster.pk}/runtime/switch/")
    assert [name for name, _ in calls] == ["cluster_switch_runtime"]


def test_the_runtime_card_says_when_the_build_is_the_newest(admin_client, build):
    assert "This is the newest certified build." in page(admin_client, make_cluster(build))


def test_the_models_card_says_truthfully_that_nothing_is_deployed(admin_client, build):
    assert "No models are deployed on this cluster yet." in page(admin_client, make_cluster(build))


def test_the_network_page_lists_the_shared_networks_with_their_marks_and_the_suggestion(admin_client, build):
    cluster = make_cluster(build)
    html = admin_client.get(f"/clusters/{cluster.pk}/network/").content.decode()
    assert "198.18.0.0/24" in html and "carries management traffic" in html
    suggested = re.search(r"<tr[^>]*>(?:(?!</tr>).)*suggested(?:(?!</tr>).)*</tr>", html, re.S).group(0)
    assert "198.18.1.0/24" in suggested and ">current<" in suggested
    assert "Changing the network restarts the cluster" in html


def test_changing_to_the_network_it_already_runs_on_shows_the_services_refusal(admin_client, build):
    cluster = make_cluster(build)
    response = admin_client.post(f"/clusters/{cluster.pk}/network/", {"network": "198.18.1.0/24"}, follow=True)
    assert "gpu-room already runs on 198.18.1.0/24." in response.content.decode()


# -- live pushes ----------------------------------------------------------------------------------


def test_render_cluster_topic_tells_the_page_a_deleted_cluster_was_deleted():
    (html,) = pages.render_cluster_topic("424242", "", roles.OPERATOR)
    assert 'id="cluster-header"' in html and 'hx-swap-oob="true"' in html
    assert "This cluster was deleted" in html and 'href="/clusters/"' in html


@pytest.mark.parametrize(("part", "ids"), [
    ("", ["cluster-header", "cluster-status", "cluster-members", "cluster-job", "cluster-runtime", "cluster-checks", "cluster-raw"]),
    ("members", ["cluster-members", "cluster-status"]),
    ("job", ["cluster-job", "cluster-header"]),
    ("checks", ["cluster-checks", "cluster-raw", "cluster-header"]),
])
def test_each_part_of_the_cluster_topic_sends_its_cards_out_of_band(build, part, ids):
    cluster = make_cluster(build)
    (html,) = pages.render_cluster_topic(str(cluster.pk), part, roles.OPERATOR)
    for card in ids:
        assert re.search(rf'id="{card}"[^>]*hx-swap-oob="true"', html), card


def test_the_list_push_carries_every_row_so_a_deleted_cluster_leaves_the_list(build):
    kept = make_cluster(build, name="kept", hosts=(11,))
    gone = make_cluster(build, name="gone", state=ClusterState.STOPPED, hosts=(12,))
    gone_pk = gone.pk
    gone.members.all().delete()
    gone.delete()
    (html,) = pages.render_clusters_topic("", str(gone_pk), roles.VIEWER)
    assert html.lstrip().startswith('<tbody id="cluster-rows" hx-swap-oob="true">')
    assert f'id="cluster-row-{kept.pk}"' in html
    assert f'id="cluster-row-{gone_pk}"' not in html


def test_the_list_shows_every_state_and_its_reason(admin_client, build):
    make_cluster(build, name="west", state=ClusterState.WAITING, hosts=(11,), reason="Free the port, then select Try again.")
    html = admin_client.get("/clusters/").content.decode()
    assert "Waiting" in html and "Free the port, then select Try again." in html


# -- finding machines among many ---------------------------------------------------------------------


def test_the_wizard_s_machine_step_shows_the_picked_machines_and_one_page_of_the_others(admin_client, build):
    picked = gpu_machine("lab-a", 11)
    for host in range(20, 80):
        gpu_machine(f"spare-{host}", host)

    html = admin_client.get(f"/clusters/new/?step=machines&name=gpu-room&machines={picked.pk}").content.decode()

    assert html.count('name="machines"') == 1 + 50  # the picked one, then the first page of the 60 others
    assert 'value="%d" aria-label="Pick lab-a"' % picked.pk in html
    assert "1–50 of 60" in html and "Page 1 of 2" in html


def test_the_wizard_asks_which_machine_leads_the_cluster_in_the_product_s_words(admin_client, build):
    first, second = gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)

    html = admin_client.get(f"/clusters/new/?step=machines&name=gpu-room&machines={first.pk},{second.pk}").content.decode()

    assert "<th>Which machine leads the cluster</th>" in html
    assert html.count('name="head"') == 2


def test_the_wizard_finds_machines_by_name_and_keeps_the_picked_ones(admin_client, build):
    picked = gpu_machine("lab-a", 11)
    for host in range(20, 80):
        gpu_machine(f"spare-{host}", host)

    html = admin_client.get(f"/clusters/new/?step=machines&name=gpu-room&machines={picked.pk}&q=spare-3").content.decode()

    assert re.findall(r'aria-label="Pick ([\w-]+)"', html) == ["lab-a", *(f"spare-3{i}" for i in range(10))]


def test_add_machines_filters_by_state_and_keeps_what_was_ticked(admin_client, build):
    cluster = make_cluster(build)
    ticked = gpu_machine("lab-x", 40)
    for host in range(41, 50):
        gpu_machine(f"spare-{host}", host)
    MachineFactory(name="lab-off", state="offline")

    html = admin_client.get(f"/clusters/{cluster.pk}/add/?state=offline&machines={ticked.pk}").content.decode()

    assert re.findall(r'aria-label="Add ([\w-]+)"', html) == ["lab-x", "lab-off"]
    assert 'value="%d" aria-label="Add lab-x" checked' % ticked.pk in html


def test_the_stop_dialog_promises_only_what_start_does_today(admin_client, build):
    html = page(admin_client, make_cluster(build))
    dialog = html[html.index('<dialog id="stop-dialog"'):html.index("</dialog>")]
    assert "Start brings it back on them" in dialog
    assert "models again" not in dialog
