"""Enrolment against the lab's machines: real SSH, the real agent, real heartbeats over HTTP."""
import http.client
import time

import pytest
from django.utils import timezone

from console.models import Job
from machines import services
from machines.choices import EventKind, MachineState
from machines.models import Machine
from tests.processes import console_processes

pytestmark = [pytest.mark.lab, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def short_heartbeats(settings):
    """Machines enrolled now beat every 2 s and read Offline after 6 s without one (the product: 10 s and 30 s)."""
    settings.FADEN_HEARTBEAT_INTERVAL = 2
    settings.FADEN_OFFLINE_AFTER = 6


def enrol(lab_machine, name: str) -> Machine:
    spec = lab_machine(name)
    machine = services.machine_create(
        name=name,
        address=spec["address"],
        ssh_port=spec["ssh_port"],
        ssh_user=spec["ssh_user"],
        host_key_fingerprint=spec["host_key_fingerprint"],
    )
    machine.refresh_from_db()
    return machine


def wait_for(predicate, *, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    return predicate()


def last_job(machine: Machine) -> Job:
    return Job.objects.filter(target_type="machine", target_id=machine.pk).first()


@pytest.mark.parametrize(
    ("name", "arch", "count", "model", "memory_mib"),
    [
        ("lab-a", "x86_64", 8, "NVIDIA H100 80GB HBM3", 81559),
        ("lab-c", "x86_64", 4, "NVIDIA A100-SXM4-40GB", 40960),
        ("lab-d", "aarch64", 4, "NVIDIA GH200 96GB", None),
        ("lab-e", "x86_64", 8, "AMD Instinct MI300X", None),
    ],
)
def test_enrolment_over_ssh_reads_the_facts_the_lab_spec_gives(lab_machine, console_url, name, arch, count, model, memory_mib):
    machine = enrol(lab_machine, name)

    job = last_job(machine)
    assert job.state == "succeeded", job.error
    assert machine.state == MachineState.HEALTHY
    assert machine.arch == arch
    assert machine.hostname == name
    accelerators = list(machine.accelerators.all())
    assert len(accelerators) == count
    assert {a.model for a in accelerators} == {model}
    if memory_mib:
        assert {a.memory_mib for a in accelerators} == {memory_mib}
    assert machine.agent_version
    assert machine.container_runtime == "process"
    mgmt = machine.interfaces.get(name="eth0")
    assert mgmt.management and mgmt.default_route
    assert machine.address + "/24" in mgmt.addresses


def test_interfaces_carry_their_marks(lab_machine, console_url):
    machine = enrol(lab_machine, "lab-a")

    interfaces = {i.name: i for i in machine.interfaces.all()}
    assert {"eth0", "eth1", "eth2", "wg0"} <= set(interfaces)
    assert interfaces["wg0"].kind == "vpn"
    assert not interfaces["eth1"].management
    assert "198.18.1.11/24" in interfaces["eth1"].addresses


def test_the_agent_sends_heartbeats_to_the_console(lab_machine, console_url, short_heartbeats):
    machine = enrol(lab_machine, "lab-b")
    enrolled_at = timezone.now()

    beat = wait_for(lambda: Machine.objects.filter(pk=machine.pk, last_seen__gt=enrolled_at).exists(), timeout=25)

    assert beat, "no heartbeat reached the console within 25 s"


def test_machines_stay_healthy_behind_a_console_with_faden_secure(lab_machine, settings, short_heartbeats):
    """FADEN_SECURE=true sends browsers and the API to https, the machines' endpoints too (no exemption without
    FADEN_AGENT_PLAIN_HTTP): the heartbeats land over the agents' TLS listener, to the certificate the agent
    pinned (a console process, since the setting is read when the process starts)."""
    with console_processes(env={"FADEN_SECURE": "true", "FADEN_AGENT_PLAIN_HTTP": "0"}) as console:
        settings.FADEN_CONSOLE_URL = console.env["FADEN_CONSOLE_URL"]
        machine = enrol(lab_machine, "lab-b")
        since = timezone.now()

        assert wait_for(lambda: Machine.objects.filter(pk=machine.pk, last_seen__gt=since).exists(), timeout=25), \
            "no heartbeat reached the console within 25 s"
        redirect = http.client.HTTPConnection("127.0.0.1", console.port, timeout=10)
        redirect.request("GET", "/login/")
        assert redirect.getresponse().status == 301  # a browser is sent to https
        plain = http.client.HTTPConnection("127.0.0.1", console.port, timeout=10)
        plain.request("POST", "/agent/heartbeat/", body=b"{}", headers={"Authorization": "Bearer x"})
        assert plain.getresponse().status == 301  # no exemption: a heartbeat over plain HTTP goes nowhere


def test_enrolling_twice_installs_nothing_new(lab_machine, console_url):
    machine = enrol(lab_machine, "lab-c")

    services.machine_refresh(machine=machine)

    job = last_job(machine)
    assert job.state == "succeeded", job.error
    install = next(s for s in job.steps if s["name"] == "Install the agent")
    assert "already there" in install["detail"]


def test_a_swapped_host_key_is_refused_until_an_administrator_accepts_it(lab, lab_machine, console_url):
    machine = enrol(lab_machine, "lab-c")
    pinned = machine.host_key_fingerprint

    lab.fault("lab-c", "swap-host-key")
    services.machine_refresh(machine=machine)

    machine.refresh_from_db()
    offered = lab_machine("lab-c")["host_key_fingerprint"]
    assert offered != pinned
    assert machine.state == MachineState.FAILED
    assert pinned in machine.state_reason and offered in machine.state_reason
    assert machine.offered_host_key_fingerprint == offered
    assert last_job(machine).state == "failed"

    services.machine_trust_host_key(machine=machine, fingerprint=offered)

    machine.refresh_from_db()
    assert machine.state == MachineState.HEALTHY
    assert machine.host_key_fingerprint == offered


def test_a_machine_powered_off_goes_offline_and_comes_back(lab, lab_machine, console_url, short_heartbeats):
    machine = enrol(lab_machine, "lab-d")
    assert wait_for(lambda: Machine.objects.get(pk=machine.pk).last_seen, timeout=15)

    lab.fault("lab-d", "power-off")
    offline = wait_for(lambda: machine.pk in services.machines_mark_offline(), timeout=60, interval=1)

    assert offline, "the machine was not marked Offline within 60 s of losing power"
    machine.refresh_from_db()
    assert machine.state == MachineState.OFFLINE
    assert "No heartbeat" in machine.state_reason

    lab.fault("lab-d", "power-on")
    back = wait_for(lambda: Machine.objects.get(pk=machine.pk).state == MachineState.HEALTHY, timeout=30)

    assert back, "the machine did not come back Healthy within 30 s of power-on"
    assert machine.events.filter(kind=EventKind.RECONNECTED).exists()


def test_update_agent_installs_the_console_s_agent_and_brings_its_heartbeat_back(lab, lab_machine, console_url,
                                                                                short_heartbeats):
    from machines.agent import agent_version

    machine = enrol(lab_machine, "lab-d")
    # An agent older than the console's, as a machine enrolled before an upgrade has it: the console's
    # build is not on the machine, and its heartbeat (an old one, stopped here) is not the console's.
    lab.fault("lab-d", "kill-process", "heartbeat run")
    assert lab.ssh(machine.address, "rm -f /opt/fadenstack/agent/fadenstack-agent-*.pyz").returncode == 0
    Machine.objects.filter(pk=machine.pk).update(agent_version="0.2.0")  # after its last beat, which says its own
    machine.refresh_from_db()
    assert machine.agent_outdated

    job = services.machine_update_agent(machine=machine)

    job.refresh_from_db()
    assert job.state == "succeeded", job.error
    assert "The heartbeat is not running" in job.log and f"Agent 0.2.0 → {agent_version()}" in job.log
    machine.refresh_from_db()
    assert machine.agent_version == agent_version() and not machine.agent_outdated
    assert lab.ssh(machine.address, f"test -f {machine.agent_path}").returncode == 0
    since = timezone.now()
    assert wait_for(lambda: Machine.objects.filter(pk=machine.pk, last_seen__gt=since).exists(), timeout=25), \
        "the restarted heartbeat did not reach the console within 25 s"
