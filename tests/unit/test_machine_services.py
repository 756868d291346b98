"""Machine services: heartbeats, going offline, facts, host keys, refreshes."""
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from console.choices import JobState
from console.models import Job
from machines import services, steps
from machines.choices import EventKind, InterfaceKind, MachineState
from machines.models import Accelerator, Machine
from tests.factories import AcceleratorFactory, JobFactory, MachineFactory, fingerprint_for

pytestmark = pytest.mark.django_db

# What `fadenstack_agent facts` prints for an 8 x H100 machine on the lab's networks.
H100_FACTS = {
    "agent_version": "0.1.0",
    "hostname": "h100-node-1",
    "arch": "x86_64",
    "cpu_count": 224,
    "memory_mib": 2063771,
    "kernel": "6.8.0-45-generic",
    "os": "Ubuntu 22.04.4 LTS",
    "store": {"path": "/var/lib/fadenstack", "free_bytes": 6_543_210_987_520, "total_bytes": 7_681_501_126_656},
    "accelerators": [
        {
            "index": i,
            "vendor": "nvidia",
            "model": "NVIDIA H100 80GB HBM3",
            "memory_mib": 81559,
            "uuid": f"GPU-4b2c{i:04x}-1f0e-8d1a-9c3b-5e6f7a8b9c0d",
            "pci_bus_id": f"00000000:{0x18 + i * 0x10:02X}:00.0",
        }
        for i in range(8)
    ],
    "interfaces": [
        {"name": "lo", "kind": "loopback", "mac": "00:00:00:00:00:00", "mtu": 65536, "state": "up",
         "addresses": ["127.0.0.1/8", "::1/128"], "speed_mbps": None, "default_route": False, "master": None},
        {"name": "eno1", "kind": "physical", "mac": "7c:c2:55:10:20:30", "mtu": 1500, "state": "up",
         "addresses": ["192.168.10.21/24"], "speed_mbps": 10000, "default_route": True, "master": None},
        {"name": "ens1f0", "kind": "physical", "mac": "b8:3f:d2:00:00:01", "mtu": 9000, "state": "up",
         "addresses": ["198.18.0.11/24"], "speed_mbps": 100000, "default_route": False, "master": None},
        {"name": "ibp12s0", "kind": "physical", "mac": "00:00:10:29:fe:80", "mtu": 4092, "state": "up",
         "addresses": ["10.20.0.11/16"], "speed_mbps": 400000, "default_route": False, "master": None},
        {"name": "wg0", "kind": "vpn", "mac": None, "mtu": 1420, "state": "up",
         "addresses": ["10.99.0.11/24"], "speed_mbps": None, "default_route": False, "master": None},
        {"name": "docker0", "kind": "virtual", "mac": "02:42:ac:11:00:01", "mtu": 1500, "state": "down",
         "addresses": ["172.17.0.1/16"], "speed_mbps": -1, "default_route": False, "master": None},
    ],
    "container_runtime": {"name": "docker", "version": "27.3.1"},
    "warnings": [],
}


def beat(machine: Machine, payload: dict | None = None):
    token, token_hash = services.heartbeat_token_new()
    Machine.objects.filter(pk=machine.pk).update(heartbeat_token_hash=token_hash)
    return services.machine_heartbeat(machine=services.machine_by_heartbeat_token(token), payload=payload or {})


# -- going offline, coming back ------------------------------------------------------------


def test_mark_offline_marks_a_healthy_machine_silent_for_longer_than_the_limit_offline(settings):
    settings.FADEN_OFFLINE_AFTER = 30
    now = timezone.now()
    silent = MachineFactory(last_seen=now - timedelta(seconds=45))

    assert services.machines_mark_offline(now=now) == [silent.pk]

    silent.refresh_from_db()
    assert silent.state == MachineState.OFFLINE
    assert silent.state_reason == "No heartbeat for 45 s."


def test_mark_offline_leaves_machines_that_beat_within_the_limit_alone(settings):
    settings.FADEN_OFFLINE_AFTER = 30
    now = timezone.now()
    fresh = MachineFactory(last_seen=now - timedelta(seconds=29))

    assert services.machines_mark_offline(now=now) == []

    fresh.refresh_from_db()
    assert fresh.state == MachineState.HEALTHY
    assert fresh.state_reason == ""


def test_mark_offline_leaves_machines_that_are_not_healthy_alone(settings):
    settings.FADEN_OFFLINE_AFTER = 30
    long_ago = timezone.now() - timedelta(hours=1)
    failed = MachineFactory(state=MachineState.FAILED, last_seen=long_ago)
    enrolling = MachineFactory(state=MachineState.ENROLLING, last_seen=long_ago)

    assert services.machines_mark_offline() == []

    assert Machine.objects.get(pk=failed.pk).state == MachineState.FAILED
    assert Machine.objects.get(pk=enrolling.pk).state == MachineState.ENROLLING


def test_heartbeat_with_the_machines_token_updates_last_seen():
    machine = MachineFactory(last_seen=timezone.now() - timedelta(seconds=20))
    before = machine.last_seen

    assert beat(machine).pk == machine.pk

    machine.refresh_from_db()
    assert machine.last_seen > before
    assert machine.state == MachineState.HEALTHY


def test_heartbeat_records_a_new_agent_version():
    machine = MachineFactory(agent_version="0.1.0")
    beat(machine, {"agent_version": "0.2.0"})
    machine.refresh_from_db()
    assert machine.agent_version == "0.2.0"


def test_heartbeat_brings_an_offline_machine_back_to_healthy_and_says_it_reconnected():
    machine = MachineFactory(
        state=MachineState.OFFLINE, state_reason="No heartbeat for 40 s.", last_seen=timezone.now() - timedelta(minutes=5)
    )

    beat(machine)

    machine.refresh_from_db()
    assert machine.state == MachineState.HEALTHY
    assert machine.state_reason == ""
    reconnected = machine.events.get(kind=EventKind.RECONNECTED)
    assert reconnected.message.startswith("Reconnected after 5")
    assert reconnected.message.endswith("without a heartbeat.")
    assert machine.events.filter(kind=EventKind.STATE, message="Offline → Healthy").exists()


def test_heartbeat_of_a_healthy_machine_records_no_event():
    machine = MachineFactory()
    beat(machine)
    assert not machine.events.exists()


@pytest.mark.parametrize("token", ["not-a-token-any-machine-holds", "", "x" * 500])
def test_a_token_no_machine_holds_finds_no_machine(token):
    _, token_hash = services.heartbeat_token_new()
    MachineFactory(last_seen=None, heartbeat_token_hash=token_hash)  # it holds a token, just not this one

    assert services.machine_by_heartbeat_token(token) is None


def test_a_machine_without_a_token_does_not_answer_to_an_empty_one():
    MachineFactory(heartbeat_token_hash="")
    assert services.machine_by_heartbeat_token("") is None


def test_a_heartbeat_of_a_machine_deleted_meanwhile_finds_no_machine():
    machine = MachineFactory()
    found = Machine.objects.get(pk=machine.pk)
    machine.delete()

    assert services.machine_heartbeat(machine=found, payload={}) is None


# -- facts -----------------------------------------------------------------------------------


def test_facts_apply_stores_the_machines_summary_fields():
    machine = MachineFactory(address="198.18.0.11", arch="", agent_version="")

    services.machine_facts_apply(machine=machine, facts=H100_FACTS)

    machine.refresh_from_db()
    assert machine.hostname == "h100-node-1"
    assert machine.arch == "x86_64"
    assert machine.cpu_count == 224
    assert machine.memory_mib == 2063771
    assert machine.store_path == "/var/lib/fadenstack"
    assert machine.store_free_bytes == 6_543_210_987_520
    assert machine.container_runtime == "docker"
    assert machine.agent_version == "0.1.0"
    assert machine.facts_at is not None
    assert machine.facts == H100_FACTS


def test_facts_apply_stores_every_accelerator():
    machine = MachineFactory(address="198.18.0.11")

    services.machine_facts_apply(machine=machine, facts=H100_FACTS)

    accelerators = list(machine.accelerators.all())
    assert [a.index for a in accelerators] == list(range(8))
    assert {a.model for a in accelerators} == {"NVIDIA H100 80GB HBM3"}
    assert {a.memory_mib for a in accelerators} == {81559}
    assert accelerators[1].pci_bus_id == "00000000:28:00.0"
    assert machine.accelerator_summary() == "8 x H100 80GB"


def test_facts_apply_replaces_what_an_earlier_read_reported():
    machine = MachineFactory(address="198.18.0.11")
    AcceleratorFactory.create_batch(4, machine=machine, model="NVIDIA A100-SXM4-40GB")

    services.machine_facts_apply(machine=machine, facts=H100_FACTS)
    services.machine_facts_apply(machine=machine, facts=H100_FACTS)

    assert machine.accelerators.count() == 8
    assert machine.interfaces.count() == len(H100_FACTS["interfaces"])


def test_facts_apply_marks_the_default_route_and_the_consoles_address_as_management():
    machine = MachineFactory(address="198.18.0.11")

    services.machine_facts_apply(machine=machine, facts=H100_FACTS)

    interfaces = {i.name: i for i in machine.interfaces.all()}
    assert interfaces["eno1"].default_route and interfaces["eno1"].management
    assert interfaces["ens1f0"].management and not interfaces["ens1f0"].default_route
    assert {name for name, i in interfaces.items() if i.management} == {"eno1", "ens1f0"}


def test_facts_apply_keeps_each_interfaces_kind_addresses_and_speed():
    machine = MachineFactory(address="198.18.0.11")

    services.machine_facts_apply(machine=machine, facts=H100_FACTS)

    interfaces = {i.name: i for i in machine.interfaces.all()}
    assert interfaces["wg0"].kind == InterfaceKind.VPN and interfaces["wg0"].is_vpn
    assert interfaces["lo"].kind == InterfaceKind.LOOPBACK
    assert interfaces["docker0"].kind == InterfaceKind.VIRTUAL
    assert interfaces["ibp12s0"].speed_mbps == 400000
    assert interfaces["ibp12s0"].addresses == ["10.20.0.11/16"]
    assert interfaces["docker0"].speed_mbps is None  # -1 means unknown
    assert interfaces["wg0"].mac == ""


def test_facts_apply_counts_an_interface_of_an_unknown_kind_as_physical():
    machine = MachineFactory()
    facts = {"interfaces": [{"name": "eth9", "kind": "quantum", "addresses": []}]}
    services.machine_facts_apply(machine=machine, facts=facts)
    assert machine.interfaces.get().kind == InterfaceKind.PHYSICAL


def test_facts_apply_marks_the_interface_holding_an_ipv6_address_as_management():
    machine = MachineFactory(address="fd00::11")
    facts = {"interfaces": [{"name": "eth1", "kind": "physical", "addresses": ["fd00::11/64"], "default_route": False}]}
    services.machine_facts_apply(machine=machine, facts=facts)
    assert machine.interfaces.get().management


def test_facts_apply_marks_the_consoles_address_as_management_however_it_was_written():
    machine = MachineFactory(address="FD00:0:0::11")
    facts = {"interfaces": [{"name": "eth1", "kind": "physical", "addresses": ["fd00::11/64"], "default_route": False}]}
    services.machine_facts_apply(machine=machine, facts=facts)
    assert machine.interfaces.get().management


# -- accelerators as people say them --------------------------------------------------------------


@pytest.mark.parametrize(
    "count, model, summary",
    [
        (8, "NVIDIA H100 80GB HBM3", "8 x H100 80GB"),
        (4, "NVIDIA A100-SXM4-40GB", "4 x A100 40GB"),
        (4, "NVIDIA A100-PCIE-40GB", "4 x A100 40GB"),
        (8, "AMD Instinct MI300X", "8 x Instinct MI300X"),
        (2, "NVIDIA L4", "2 x L4"),
    ],
)
def test_accelerator_summary_says_the_model_as_people_say_it(count, model, summary):
    machine = MachineFactory()
    AcceleratorFactory.create_batch(count, machine=machine, model=model)
    assert machine.accelerator_summary() == summary


def test_accelerator_summary_drops_the_form_factor_of_an_amd_card_as_rocm_smi_reports_it():
    machine = MachineFactory()
    AcceleratorFactory.create_batch(8, machine=machine, vendor="amd", model="AMD Instinct MI300X OAM")
    assert machine.accelerator_summary() == "8 x Instinct MI300X"


def test_accelerator_summary_of_a_mixed_machine_names_each_model():
    machine = MachineFactory()
    AcceleratorFactory.create_batch(4, machine=machine, model="NVIDIA A100-SXM4-40GB")
    AcceleratorFactory.create_batch(2, machine=machine, model="NVIDIA L4")
    assert machine.accelerator_summary() == "4 x A100 40GB + 2 x L4"


def test_accelerator_summary_of_a_machine_without_accelerators_is_empty():
    assert MachineFactory().accelerator_summary() == ""


# -- host keys and refreshes ----------------------------------------------------------------------


def test_trust_host_key_refuses_a_fingerprint_other_than_the_offered_one():
    machine = MachineFactory(awaiting_host_key=True)
    offered = machine.offered_host_key_fingerprint
    other = fingerprint_for("someone else")

    with pytest.raises(ValidationError) as caught:
        services.machine_trust_host_key(machine=machine, fingerprint=other)

    message = " ".join(caught.value.messages)
    assert offered in message and other in message
    machine.refresh_from_db()
    assert machine.host_key_fingerprint == ""
    assert machine.state == MachineState.HOST_KEY
    assert not Job.objects.exists()


def test_trust_host_key_refuses_when_no_key_is_waiting():
    machine = MachineFactory()
    with pytest.raises(ValidationError, match="no new host key waiting"):
        services.machine_trust_host_key(machine=machine, fingerprint=machine.host_key_fingerprint)


def test_trust_host_key_pins_the_offered_key_and_starts_enrolment(django_capture_on_commit_callbacks, enrol_calls):
    machine = MachineFactory(awaiting_host_key=True)
    offered = machine.offered_host_key_fingerprint

    with django_capture_on_commit_callbacks(execute=True):
        job = services.machine_trust_host_key(machine=machine, fingerprint=offered)

    machine.refresh_from_db()
    assert machine.host_key_fingerprint == offered
    assert machine.offered_host_key_fingerprint == ""
    assert machine.state == MachineState.ENROLLING
    assert job.kind == "machine.enrol" and job.state == JobState.QUEUED
    assert enrol_calls == [job.pk]
    assert machine.events.filter(kind=EventKind.HOST_KEY, message=f"Host key {offered} trusted.").exists()


def test_trust_host_key_after_a_change_names_the_key_it_replaces(enrol_calls):
    old = fingerprint_for("before the reinstall")
    new = fingerprint_for("after the reinstall")
    machine = MachineFactory(state=MachineState.FAILED, host_key_fingerprint=old, offered_host_key_fingerprint=new)

    services.machine_trust_host_key(machine=machine, fingerprint=new)

    assert machine.events.filter(message=f"Host key {new} trusted in place of {old}.").exists()


@pytest.mark.parametrize("state", [JobState.QUEUED, JobState.RUNNING])
def test_refresh_refuses_while_a_job_runs_on_the_machine(state):
    machine = MachineFactory()
    JobFactory(target_id=machine.pk, state=state)

    with pytest.raises(ValidationError, match="already running"):
        services.machine_refresh(machine=machine)

    assert Job.objects.filter(target_id=machine.pk).count() == 1


def test_refresh_refuses_a_machine_whose_host_key_is_not_confirmed():
    with pytest.raises(ValidationError, match="Confirm the machine's host key first"):
        services.machine_refresh(machine=MachineFactory(awaiting_host_key=True))


def test_refresh_after_an_earlier_job_finished_queues_a_new_one(django_capture_on_commit_callbacks, enrol_calls):
    machine = MachineFactory()
    JobFactory(target_id=machine.pk, state=JobState.SUCCEEDED)

    with django_capture_on_commit_callbacks(execute=True):
        job = services.machine_refresh(machine=machine)

    assert job.kind == "machine.refresh"
    assert [step["name"] for step in job.steps] == steps.ENROL.step_names
    assert enrol_calls == [job.pk]
    machine.refresh_from_db()
    assert machine.state == MachineState.HEALTHY


def test_refresh_of_a_failed_machine_enrols_it_again(enrol_calls):
    machine = MachineFactory(state=MachineState.FAILED, state_reason="Could not reach it.")
    job = services.machine_refresh(machine=machine)
    machine.refresh_from_db()
    assert machine.state == MachineState.ENROLLING
    assert job.kind == "machine.enrol"


def test_delete_asks_running_jobs_to_cancel_and_forgets_the_machine():
    machine = MachineFactory()
    running = JobFactory(target_id=machine.pk, state=JobState.RUNNING)
    AcceleratorFactory(machine=machine)

    services.machine_delete(machine=machine)

    assert not Machine.objects.filter(name=machine.name).exists()
    assert not Accelerator.objects.exists()
    running.refresh_from_db()
    assert running.cancel_requested
