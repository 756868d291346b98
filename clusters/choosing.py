"""Before a cluster exists: the wizard's checks of its name and of the picked machines and head, and
the live test of the networks they share. services.cluster_create checks again with these, and the
services that take machine ids name the unknown ones with ``refuse_unknown``."""
from __future__ import annotations

from django.core.exceptions import ValidationError

from clusters import actions, planning, selectors, steps
from clusters.models import Cluster
from clusters.validators import name_taken, validate_cluster_name
from console import roles
from console.jobs import job_start
from console.models import Job


def cluster_name_check(name: str) -> None:
    """The name's rules (``validators.validate_cluster_name``), and that no cluster has it yet."""
    try:
        validate_cluster_name(name)
    except ValidationError as exc:
        raise ValidationError({"name": exc.messages}) from None
    if Cluster.objects.filter(name=name).exists():
        raise ValidationError({"name": name_taken(name)})


def _refuse_head_outside(head_id: int, machine_ids) -> None:
    if head_id not in machine_ids:
        raise ValidationError({"head": "The head must be one of the picked machines."})


def refuse_unknown(machine_ids: list[int], found) -> None:
    """A ValidationError naming every id in ``machine_ids`` that is not in ``found`` (no machine has it)."""
    missing = sorted(set(machine_ids) - set(found))
    if missing:
        raise ValidationError({"machines": f"No machine has the id {', '.join(map(str, missing))}."})


def cluster_plan_check(*, machine_ids: list[int], head_id: int | None) -> tuple[list[planning.Candidate], dict]:
    """The picked machines and their verdicts; a ValidationError names every machine that cannot be picked."""
    if not machine_ids:
        raise ValidationError({"machines": "Pick at least one machine."})
    picked = selectors.candidates(machine_ids)
    refuse_unknown(machine_ids, {c.id for c in picked})
    if head_id is not None:
        _refuse_head_outside(head_id, machine_ids)
    verdicts = planning.pick_check(picked, selectors.image_builds(), head_id=head_id)
    refusals = [verdicts[c.id].refusal for c in picked if not verdicts[c.id].selectable]
    if refusals:
        raise ValidationError({"machines": refusals})
    return picked, verdicts


# -- network tests --------------------------------------------------------------------------------


def network_probe_start(*, machine_ids: list[int], head_id: int, user=None) -> Job:
    """Measure every shared network between the head and each other machine (the wizard's live test)."""
    actions.TEST_NETWORKS.offer(roles.acting(user)).check()
    picked = selectors.candidates(machine_ids)
    found = {c.id for c in picked}
    refuse_unknown(machine_ids, found)
    if len(picked) < 2:
        raise ValidationError({"machines": "A network test needs at least two machines."})
    _refuse_head_outside(head_id, found)
    networks = planning.shared_networks(picked)
    if not networks:
        raise ValidationError(planning.NO_SHARED_NETWORK)
    return job_start(
        kind=steps.PROBE_KIND, title="Network test", target_type="probe", target_id=head_id,
        steps=[str(n.subnet) for n in networks], user=user, params={"machines": sorted(machine_ids), "head": head_id},
    )
