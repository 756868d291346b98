"""The cluster's file-server token: the machines' file servers (agent ``blob serve``) answer only a fetch
that sends it, so a machine off the cluster cannot read its models and images.

One per cluster, random, made by the console and sealed with the secrets key (``console/secrets.py``, under
``cluster.<id>.files_token``); given to each machine's server on stdin (``blob serve start --token-stdin``)
and to the machines that fetch from it in the fetch's source (stdin too). Only agents 0.10.0 and later take it:
an older machine's server keeps serving without one, and its fetchers send the token only to newer servers.
"""
from __future__ import annotations

from console import secrets
from machines.versions import agent_outdated

TOKEN_AGENT = "0.10.0"  # the first agent whose file server takes its token on stdin


def _name(cluster_id: int) -> str:
    return f"cluster.{cluster_id}.files_token"


def files_token(cluster) -> str:
    """The cluster's token, made and sealed the first time."""
    return secrets.secret_random(_name(cluster.pk))


def files_token_forget(cluster) -> None:
    secrets.secret_clear(_name(cluster.pk))


def takes_token(machine) -> bool:
    """Whether this machine's file server takes (and then requires) the cluster's token."""
    return not agent_outdated(machine.agent_version, TOKEN_AGENT)
