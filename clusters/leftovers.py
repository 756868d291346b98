"""What a deleted cluster leaves on a machine, and freeing it from the machine's page.

Deleting a cluster stops it and takes its node settings away, but keeps what is costly to bring back
and may be wanted again: the runtime images in each machine's store, the model files there
(deployments' card on the same page removes those), and the files in the head's ``/shared``. The
machine's page offers to free the first and the last, each a job on the machine (the agent's ``image
remove`` and ``shared clear``, agent 0.9), refused while a cluster on the machine uses them.
"""
from __future__ import annotations

from django.db import transaction

from clusters.choices import ClusterState
from clusters.models import ClusterMember
from console import roles
from console.choices import JOB_ACTIVE, ErrorKind
from console.jobs import JobContext, JobError, Operation, Step, job_start
from console.models import Job
from console.offers import ALLOWED, Offer
from console.roles import OPERATOR, Action
from machines.agent_client import Agent, AgentError
from machines.choices import MachineState
from machines.models import Machine
from machines.versions import agent_outdated

FREE_AGENT = "0.9.0"  # the first agent with image remove and shared clear
FREE_IMAGES, FREE_SHARED = Step("Free the runtime images"), Step("Free /shared")
IMAGES_FREE = Operation("machine.free-images", (FREE_IMAGES,))
SHARED_FREE = Operation("machine.free-shared", (FREE_SHARED,))
IMAGES_KIND, SHARED_KIND = IMAGES_FREE.kind, SHARED_FREE.kind
IMAGES = Action("freeing a machine's runtime images", OPERATOR)
SHARED = Action("freeing what a deleted cluster left in a machine's /shared", OPERATOR)


def gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def _membership(machine: Machine) -> ClusterMember | None:
    return ClusterMember.objects.select_related("cluster").filter(machine=machine).first()


def _machine_refusal(machine: Machine, *, busy: bool) -> str:
    """What keeps any job from running on the machine now, or ""."""
    if machine.state != MachineState.HEALTHY:
        return f"{machine.name} is {machine.get_state_display().lower()}: its agent must answer."
    if agent_outdated(machine.agent_version, FREE_AGENT):
        return (f"{machine.name}'s agent {machine.agent_version or '(unknown)'} is older than {FREE_AGENT}: "
                "select Update agent first.")
    if busy:
        return f"A job is already running on {machine.name}; wait for it to finish."
    return ""


def images_refusal(machine: Machine, membership: ClusterMember | None) -> str:
    """A cluster that is not stopped runs its runtime from the image: it stays while it does."""
    if membership is not None and membership.cluster.state != ClusterState.STOPPED:
        cluster = membership.cluster
        return (f"{machine.name} runs {cluster.name}'s runtime ({cluster.get_state_display().lower()}): its image "
                f"stays while the cluster uses it. Stop or delete {cluster.name} first.")
    return ""


def shared_refusal(machine: Machine, membership: ClusterMember | None) -> str:
    """/shared on a machine of a cluster is that cluster's: the head's files, or a mount of them."""
    if membership is not None:
        cluster = membership.cluster
        return (f"{machine.name} is in {cluster.name}: /shared there holds the cluster's files. Delete {cluster.name} "
                f"or take {machine.name} out of it first.")
    return ""


def machine_busy(machine: Machine) -> bool:
    return Job.objects.filter(target_type="machine", target_id=machine.pk, state__in=JOB_ACTIVE).exists()


def leftovers_offers(machine: Machine, *, role: roles.Role | None, busy: bool | None = None) -> dict[str, Offer]:
    """The two buttons of the machine page's card, for ``role``: the role first, then the clusters, then the machine."""
    membership = _membership(machine)
    busy = machine_busy(machine) if busy is None else busy
    state = _machine_refusal(machine, busy=busy)
    images = images_refusal(machine, membership) or state
    shared = shared_refusal(machine, membership) or state
    return {"images": IMAGES.offer(role).then(Offer(False, images) if images else ALLOWED),
            "shared": SHARED.offer(role).then(Offer(False, shared) if shared else ALLOWED)}


def machine_images_free(*, machine: Machine, user=None) -> Job:
    """Free the runtime images deleted clusters left in the machine's store: a job on the machine."""
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).get(pk=machine.pk)
        leftovers_offers(machine, role=roles.acting(user))["images"].check()
        return job_start(kind=IMAGES_KIND, title=f"Free the runtime images on {machine.name}", target_type="machine",
                         target_id=machine.pk, steps=IMAGES_FREE.step_names, user=user)


def machine_shared_free(*, machine: Machine, user=None) -> Job:
    """Empty the /shared a deleted cluster left on its former head: a job on the machine."""
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).get(pk=machine.pk)
        leftovers_offers(machine, role=roles.acting(user))["shared"].check()
        return job_start(kind=SHARED_KIND, title=f"Free /shared on {machine.name}", target_type="machine",
                         target_id=machine.pk, steps=SHARED_FREE.step_names, user=user)


def machine_images_free_run(ctx: JobContext, *, machine_id: int) -> None:
    """The job: asked again first (a cluster may have started on the machine since), then ``image remove``."""
    machine, freed = _free_run(ctx, machine_id, FREE_IMAGES, images_refusal, lambda agent: agent.image_remove())
    count = len(freed.removed)
    ctx.log(f"{machine.name}: {count} runtime image{'' if count == 1 else 's'} removed, {gb(freed.freed)} freed"
            + "".join(f"; kept {digest[:12]}: {why}" for digest, why in freed.kept)
            + "".join(f"; {w}" for w in freed.warnings))


def machine_shared_free_run(ctx: JobContext, *, machine_id: int) -> None:
    """The job: asked again first, then ``shared clear`` (which refuses too while a cluster holds /shared)."""
    machine, cleared = _free_run(ctx, machine_id, FREE_SHARED, shared_refusal, lambda agent: agent.shared_clear())
    ctx.log(f"{machine.name}: {cleared.removed} files and directories removed from /shared, {gb(cleared.freed)} freed")


def _free_run(ctx: JobContext, machine_id: int, step: Step, refusal_of, command):
    """Both freeing jobs: the rule asked again, then the agent's command; its refusal ends the job in its words."""
    machine = Machine.objects.get(pk=machine_id)
    step.always(ctx, machine.name)
    if refusal := refusal_of(machine, _membership(machine)):
        raise JobError(refusal, kind=ErrorKind.NOT_RETRYABLE)
    try:
        with Agent.open(machine) as agent:
            return machine, command(agent)
    except AgentError as exc:
        raise JobError(f"{machine.name}: {exc.message}", kind=ErrorKind.NOT_RETRYABLE) from exc


def leftovers_card(machine: Machine, role: roles.Role | None) -> dict:
    """The machine page's "Left by deleted clusters" card: what stays, and the two buttons."""
    return {"leftovers": leftovers_offers(machine, role=role), "leftovers_store": machine.store_path}
