"""The cluster's Ray token: Ray's token authentication (``RAY_AUTH_MODE=token``, Ray 2.52 and later), so
that nothing reaches the cluster's Ray (its GCS, a node's raylet or dashboard agent, Ray Client, the job
API) without it: joining, submitting a job or connecting a driver.

One per cluster, random, made by the console the first time and sealed with the secrets key
(``console/secrets.py``, under ``cluster.<id>.ray_token``). It travels to each member on stdin
(agent ``cluster secrets write``, 0.10.0 and later) into the cluster's secrets directory there
(``/etc/fadenstack/clusters/<cluster>/ray-token``, 0600), which the runtime container mounts read-only;
Ray reads it from the file (``RAY_AUTH_TOKEN_PATH``). It is never on a command line, in a log, a page or
a task's arguments. It goes with the cluster's record.
"""
from __future__ import annotations

from console import secrets
from machines.versions import agent_outdated

TOKEN_AGENT = "0.10.0"  # the first agent with `cluster secrets write`


def _name(cluster_id: int) -> str:
    return f"cluster.{cluster_id}.ray_token"


def ray_token(cluster) -> str:
    """The cluster's token, made and sealed the first time."""
    return secrets.secret_random(_name(cluster.pk))


def ray_token_forget(cluster) -> None:
    secrets.secret_clear(_name(cluster.pk))


def takes_token(machine) -> bool:
    """Whether this machine's agent can hold the cluster's Ray token."""
    return not agent_outdated(machine.agent_version, TOKEN_AGENT)
