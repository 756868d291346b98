"""What deployments need of a cluster's machines beyond the role, and when not, the sentence that says why.

Deploy itself is the cluster's action as much as the deployments' (its page offers the button): the action
and its rule, a running cluster, are written once in ``clusters/actions.py``, and deployments import them
from there.
"""
from __future__ import annotations

from deployments.store.actions import outdated_agents

COPIES_AGENT = "0.5.0"  # the first agent with copy start|stop|list


def copies_agents_refusal(cluster) -> str | None:
    """Why copies cannot run on the cluster's machines yet (an agent older than COPIES_AGENT); None when they can."""
    return outdated_agents(cluster, needed=COPIES_AGENT, what="Deployments")
