"""Which actions a model allows now, to which role, and when not, the sentence that says why."""
from __future__ import annotations

from console import roles
from console.offers import Offer
from console.roles import OPERATOR, Action
from deployments.choices import ModelState
from deployments.models import Deployment, StoredModel
from deployments.store import selectors
from machines.versions import agent_outdated

MODELS_AGENT = "0.4.0"  # the first agent with model place|list|remove|download and hub check

ADD = Action("adding a model", OPERATOR)
RETRY = Action("downloading a model again", OPERATOR)
DELETE = Action("deleting a model", OPERATOR)
COPY = Action("copying a model to a cluster's machines", OPERATOR)
REMOVE = Action("removing a model's files from machines", OPERATOR)


def model_actions(model: StoredModel, *, role: roles.Role | None) -> dict[str, Offer]:
    ready = model.state == ModelState.READY
    not_ready = f"{model} is {model.get_state_display().lower()}: its files are not all in the store yet."
    refusal = model_delete_refusal(model)
    return {
        "retry": RETRY.offer(role).then(Offer(model.state == ModelState.FAILED, "Only a failed download is tried again.")),
        "delete": DELETE.offer(role).then(Offer(not refusal, refusal or "")),
        "copy": COPY.offer(role).then(Offer(ready, not_ready)),
        "remove": REMOVE.offer(role).then(Offer(model.holdings.exists(), "No machine holds its files.")),
    }


def model_delete_refusal(model: StoredModel) -> str | None:
    """Why the model may not be deleted now, in words; None when it may."""
    if job := selectors.model_active_job(model):
        return f"{model} has a job running ({job.title}): wait for it to end."
    users = list(Deployment.objects.shown().filter(model=model).values_list("name", flat=True))
    if users:
        return f"{model} is used by the deployment{'s' if len(users) > 1 else ''} {', '.join(users)}: delete them first."
    left = list(Deployment.objects.filter(model=model, orphaned_at__isnull=False).values_list("name", "cluster__name"))
    if left:
        return (f"{model} runs without a deployment as {', '.join(f'{n} on {c}' for n, c in left)}: take "
                f"{'them' if len(left) > 1 else 'it'} over on the cluster's page first.")
    held = list(model.holdings.values_list("machine__name", flat=True))
    if held:
        return (f"{', '.join(held)} still hold{'s' if len(held) == 1 else ''} {model}'s files: remove them from "
                "the machines first (Remove on each machine below).")
    return None


def outdated_agents(cluster, *, needed: str, what: str) -> str | None:
    """Why ``what`` cannot run on the cluster's machines yet (an agent older than ``needed``); None when it can."""
    old = [m.machine for m in cluster.members.select_related("machine") if agent_outdated(m.machine.agent_version, needed)]
    if not old:
        return None
    names = ", ".join(f"{m.name} ({m.agent_version or 'unknown'})" for m in old)
    return (f"{what} need agent {needed} or newer on every machine; {names} run{'s' if len(old) == 1 else ''} an older "
            "one: select Update agent on its page first.")


def agents_refusal(cluster) -> str | None:
    """Why the cluster's machines cannot take models yet (an agent older than MODELS_AGENT); None when they can."""
    return outdated_agents(cluster, needed=MODELS_AGENT, what="Models")
