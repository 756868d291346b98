"""The machines' jobs, as a job kind and its steps each, defined once (``console.jobs``'s ``Step`` and
``Operation``).

The services start a job with its operation's step names (the job's card shows them all before they
run); the runners (``enrolment.py``, ``agent_update.py``) begin each step through the same object, so a
step cannot be renamed on one side only.
"""
from __future__ import annotations

from console.jobs import Operation, Step

CONNECT = Step("Connect")
CHECK_PYTHON = Step("Check Python")
INSTALL_AGENT = Step("Install the agent")
READ_FACTS = Step("Read facts")
START_HEARTBEAT = Step("Start the heartbeat")
RESTART_HEARTBEAT = Step("Restart the heartbeat")
CHECK_VERSION = Step("Check the version")

ENROL = Operation("machine.enrol", (CONNECT, CHECK_PYTHON, INSTALL_AGENT, READ_FACTS, START_HEARTBEAT))
# Refresh facts runs the enrolment again on an enrolled machine: a kind of its own (the machine does not
# read Enrolling meanwhile), the same steps and the same task.
REFRESH = Operation("machine.refresh", ENROL.steps)
# Update agent installs the same way, then restarts the heartbeat alone and checks what runs.
UPDATE_AGENT = Operation("machine.update_agent", (CONNECT, CHECK_PYTHON, INSTALL_AGENT, RESTART_HEARTBEAT, CHECK_VERSION))
