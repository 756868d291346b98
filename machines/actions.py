"""What a machine allows now, and to whom; when not, the sentence that says why.

Adding and deleting a machine and trusting its host key decide which machines the console trusts
with its SSH key: an Administrator's, and so is choosing the container runtime its clusters run in. Refreshing facts runs the enrolment again on a machine whose
key is trusted already (and brings its agent up to date, which a cluster may need): an Operator's.
Updating the agent installs the console's agent on such a machine and restarts its heartbeat
alone, leaving what runs there running: an Operator's too.
The services refuse with these offers, the pages grey their buttons out with them, and the API
answers with them.
"""
from __future__ import annotations

from console import roles
from console.offers import ALLOWED, Offer
from console.roles import ADMINISTRATOR, OPERATOR, Action
from machines.choices import MachineState
from machines.models import Machine

ADD = Action("adding a machine", ADMINISTRATOR)
TRUST = Action("trusting a host key", ADMINISTRATOR)
DELETE = Action("deleting a machine", ADMINISTRATOR)
REFRESH = Action("refreshing a machine's facts", OPERATOR)
UPDATE_AGENT = Action("updating a machine's agent", OPERATOR)
# Which engine runs the machine's containers: like enrolling it, an Administrator's.
CHOOSE_RUNTIME = Action("choosing a machine's container runtime", ADMINISTRATOR)


def refresh_offer(machine: Machine, *, busy: bool, role: roles.Role | None) -> Offer:
    """Refresh facts: not before the host key is confirmed, nor beside another job on the machine."""
    if machine.state == MachineState.HOST_KEY or (machine.offered_host_key_fingerprint and machine.state == MachineState.FAILED):
        state = Offer(False, "Confirm the machine's host key first.")
    elif busy:
        state = Offer(False, "A job is already running on this machine; wait for it to finish.")
    else:
        state = ALLOWED
    return REFRESH.offer(role).then(state)


def update_agent_offer(machine: Machine, *, busy: bool, role: roles.Role | None) -> Offer:
    """Update agent: on a Healthy machine (it answers, and its heartbeat is what gets restarted),
    not beside another job on it. Enrolling installs the console's agent anyway; a machine that
    failed is brought back with Refresh facts, which installs it too."""
    if machine.state == MachineState.HEALTHY:
        state = Offer(False, f"A job is already running on {machine.name}; wait for it to finish.") if busy else ALLOWED
    elif machine.state == MachineState.OFFLINE:
        state = Offer(False, f"{machine.name} is offline: its agent can be updated once it beats again.")
    elif machine.state == MachineState.ENROLLING:
        state = Offer(False, f"{machine.name} is being enrolled, which installs the current agent.")
    elif machine.state == MachineState.HOST_KEY or machine.offered_host_key_fingerprint:
        state = Offer(False, f"Confirm the host key of {machine.name} first.")
    else:
        state = Offer(False, f"{machine.name} failed: select Refresh facts, which also installs the current agent.")
    return UPDATE_AGENT.offer(role).then(state)


def delete_offer(machine: Machine, *, role: roles.Role | None) -> Offer:
    """Delete: not while the machine belongs to a cluster."""
    membership = getattr(machine, "membership", None)
    if membership is None:
        return DELETE.offer(role)
    return DELETE.offer(role).then(
        Offer(False, f"{machine.name} is in the cluster {membership.cluster.name}: take it out of that cluster first."))


def machine_actions(machine: Machine, *, busy: bool, role: roles.Role | None) -> dict[str, Offer]:
    """The buttons of a machine's page for ``role``; trusting a key is offered only when one waits."""
    return {
        "refresh": refresh_offer(machine, busy=busy, role=role),
        "update_agent": update_agent_offer(machine, busy=busy, role=role),
        "trust": TRUST.offer(role),
        "delete": delete_offer(machine, role=role),
        "runtime": CHOOSE_RUNTIME.offer(role),
    }
