"""A model's files onto a cluster's machines: the job behind "Copy to <cluster>'s machines", which a
deployment will use too, and removing files no copy needs.

With the cluster's model source *Server copies*, the files travel like runtime images
(``clusters/transfer.py``): one copy from the server, then machine to machine while the one before
still receives, every chunk checked, a dropped link resumed at its last verified chunk. With
*Machines download models themselves*, each machine downloads from the hub into its own store, the
server's token handed to its agent on standard input. Either way each machine's agent then places the
model (its files linked as the repository lays them out) and the server records that it holds it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from django.core import signing

from clusters.choices import ClusterState, MemberState, ModelSource, Role
from clusters.fanout import ProgressBoard, each, offline_reason, on_member, parallel
from clusters.lifecycle import cluster_changed
from clusters.models import Cluster, ClusterMember, Transfer
from clusters.transfer import ServerFile, distribute
from console import live
from console.choices import ErrorKind
from console.jobs import JobContext, JobError, Operation, Step
from deployments.models import Copy, Deployment, ModelHolding, StoredModel
from deployments.store import disk, downloads, hub
from deployments.store.hub_token import hf_token
from machines.agent_client import Agent, AgentError, FileSpec, ModelFile, ModelSpec
from machines.agent_results import PlacedModel

KIND = "model.copy"
SPACE = Step("Make room on the machines")
COPY = Step("Copy the files")
DOWNLOAD = Step("Download on each machine")
PLACE = Step("Place the model")

TOKEN_SALT = "model-file"


def copy_operation(cluster: Cluster) -> Operation:
    """The copy job's steps: the files come from the server, or each machine downloads them (its model source)."""
    return Operation(KIND, (SPACE, DOWNLOAD if cluster.model_source == ModelSource.MACHINES else COPY, PLACE))


# -- the first copy's download token ------------------------------------------------------------


@dataclass(frozen=True)
class FileGrant:
    digest: str
    cluster_id: int
    machine_id: int


def file_token(grant: FileGrant, lifetime: float) -> str:
    return signing.dumps({"digest": grant.digest, "cluster": grant.cluster_id, "machine": grant.machine_id,
                          "expires": int(time.time() + lifetime)}, salt=TOKEN_SALT, compress=False)


def file_download_refusal(token: str, *, digest: str) -> str | None:
    """Why the holder of ``token`` may not download the model file ``digest``; None when it may."""
    try:
        payload = signing.loads(token or "", salt=TOKEN_SALT)
    except signing.BadSignature:
        payload = None
    if not isinstance(payload, dict) or not isinstance(payload.get("expires"), int) or payload["expires"] <= time.time():
        return "Send a valid model file token as Authorization: Bearer (a token lasts as long as its copy's download)."
    if payload.get("digest") != digest:
        return "This token is for another file."
    if not ClusterMember.objects.filter(cluster_id=payload.get("cluster"), machine_id=payload.get("machine")).exclude(
            cluster__state=ClusterState.DELETING).exists():
        return "This token's cluster was deleted, or its machine is no longer in it."
    return None


def server_files(model: StoredModel, member: ClusterMember) -> list[ServerFile]:
    """The model's files as the transfer layer ships them, each with its first copy's token for ``member``."""
    result = []
    for f in model.files.order_by("-size", "path"):  # the weights first: the long transfer starts at once
        grant = FileGrant(digest=f.sha256, cluster_id=member.cluster_id, machine_id=member.machine_id)
        result.append(ServerFile(spec=FileSpec(digest=f.sha256, size=f.size, chunk_size=f.chunk_size, chunk_hashes=f.chunk_hashes),
                                 what=str(model), download_path=f"/agent/models/{f.sha256}/",
                                 token=lambda lifetime, grant=grant: file_token(grant, lifetime)))
    return result


# -- the job -----------------------------------------------------------------------------------------


def model_copy_run(ctx: JobContext, *, cluster_id: int, model_id: int) -> None:
    cluster = Cluster.objects.get(pk=cluster_id)
    model = StoredModel.objects.get(pk=model_id)
    members = list(cluster.members.select_related("machine").filter(state=MemberState.JOINED)
                   if cluster.state == ClusterState.RUNNING else cluster.members.select_related("machine"))
    if not members:
        raise JobError(f"{cluster.name} has no machine to copy {model} to.", kind=ErrorKind.NOT_RETRYABLE)
    failures = files_to_members(ctx, cluster, model, members)
    ctx.on_success(lambda: cluster_changed(cluster))
    if failures:
        raise JobError("; ".join(failures.values()))
    downloads.model_changed(model)


def files_to_members(ctx: JobContext, cluster: Cluster, model: StoredModel, members: list[ClusterMember],
                     *, steps: bool = True) -> dict[int, str]:
    """The model's files onto ``members`` (room made, copied or downloaded, placed), with a bar per machine;
    why each machine that did not get them did not, by member id (empty when all did)."""
    head = next((m for m in members if m.role == Role.HEAD), members[0])
    spec = model_spec(model)

    if steps:
        SPACE.always(ctx)
    freed = [line for line in each(members, lambda m: _make_disk_space(m, model)) if line]
    ctx.detail("; ".join(freed) if freed else "Every machine has room")

    board = ProgressBoard(cluster, also_push=lambda: deployments_pushed(cluster, model))
    failed: dict[int, str] = {}  # why a machine did not get the files; its state in the cluster stays as it is
    with board:
        if cluster.model_source == ModelSource.MACHINES:
            if steps:
                DOWNLOAD.always(ctx, hub.endpoint())
            done = parallel(members, head, board, lambda m, b: _download(m, model, spec, b), tolerate_all=True,
                            fail_state=None, failed=failed)
        else:
            if steps:
                COPY.always(ctx)
            done = distribute(ctx, cluster, members, head, board, lambda m: server_files(model, m),
                              receiving_state=None, failed=failed)
    if steps:
        PLACE.always(ctx)
    # A stopped cluster's machines serve nothing once the copy is done (a running one's serve the next joiner).
    stop_serving = cluster.state != ClusterState.RUNNING

    def place(member: ClusterMember) -> None:
        if failure := _place(member, model, spec, stop_serving=stop_serving):
            failed[member.pk] = failure

    each(done, place)
    if stop_serving:
        each([m for m in members if m not in done], _serve_stop)
    done_ids = {d.pk for d in done}
    return {m.pk: failed.get(m.pk) or f"{m.machine.name} did not receive the files"
            for m in members if m.pk not in done_ids or m.pk in failed}


def deployments_pushed(cluster: Cluster, model: StoredModel) -> None:
    """The pages of the deployments of the model on the cluster: their copies being copied show the same bars."""
    for pk in Deployment.objects.filter(cluster=cluster, model=model).values_list("pk", flat=True):
        live.push(f"deployment:{pk}")


def _serve_stop(member: ClusterMember) -> str | None:
    try:
        on_member(member, lambda agent: agent.serve_stop())
    except JobError as exc:
        return exc.message
    return None


def model_spec(model: StoredModel) -> ModelSpec:
    """The model as machines place it: its commit, and each file by path, sha256 and size."""
    return ModelSpec(repo=model.repo, revision=model.commit,
                     files=tuple(ModelFile(path=f.path, digest=f.sha256, size=f.size) for f in model.files.all()))


def _download(member: ClusterMember, model: StoredModel, spec: ModelSpec, board: ProgressBoard) -> None:
    """The machine downloads the model from the hub itself; the token goes to its agent on stdin only."""
    total = sum(f.size for f in spec.files)
    key = f"hub:{model.pk}"
    Transfer.objects.update_or_create(member=member, digest=key,
                                      defaults={"what": str(model), "source": f"the hub ({hub.endpoint()})", "bytes_total": total})

    done: dict[str, int] = {}  # bytes on the machine of each file (the agent reports one file at a time)

    def on_progress(event: dict) -> None:
        done[str(event.get("digest", ""))] = int(event.get("bytes", 0))
        board.transfer(member, key, bytes_done=min(sum(done.values()), total), rate=float(event.get("rate", 0)))

    on_member(member, lambda agent: agent.model_download(
        spec, endpoint=hub.endpoint(), token=hf_token() or "", timeout=total / 1_000_000 + 600,
        on_progress=on_progress, abort=offline_reason(member.machine_id)))
    board.transfer(member, key, bytes_done=total, rate=0)


def _place(member: ClusterMember, model: StoredModel, spec: ModelSpec, *, stop_serving: bool) -> str | None:
    def place(agent: Agent) -> PlacedModel:
        placed = agent.model_place(spec)
        if stop_serving:
            agent.serve_stop()
        return placed

    try:
        placed = on_member(member, place)
    except JobError as exc:
        return exc.message
    ModelHolding.objects.update_or_create(model=model, machine=member.machine,
                                          defaults={"bytes": placed.bytes, "path": placed.path})
    return None


def _make_disk_space(member: ClusterMember, model: StoredModel) -> str | None:
    """Before a model arrives: when the machine's store is short of room for it, remove the models there
    that no copy needs (none has a copy before deployments), the least recently placed first."""
    need = sum(f.size for f in model.files.all())
    listed = on_member(member, lambda agent: agent.model_list())
    if any(m.repo == model.repo and m.revision == model.commit for m in listed.models):
        return None
    if listed.free_bytes >= need:
        return None
    removed, free = [], listed.free_bytes
    # The models of copies placed on this machine stay, whatever their state: they run, or will.
    needed_by_copies = {(repo, commit) for slots, repo, commit in Copy.objects.filter(
        deployment__cluster_id=member.cluster_id).exclude(slots=[]).values_list(
        "slots", "deployment__model__repo", "deployment__model__commit")
        if any(slot["machine"] == member.machine_id for slot in slots)}
    for held in listed.models:
        if free >= need:
            break
        if (held.repo, held.revision) in needed_by_copies:
            continue
        free += on_member(member, lambda agent, h=held: agent.model_remove(repo=h.repo, revision=h.revision))
        removed.append(held.repo)
        for gone in StoredModel.objects.filter(repo=held.repo, commit=held.revision):
            files_forgotten(member.machine, gone)
        ModelHolding.objects.filter(machine=member.machine, model__repo=held.repo, model__commit=held.revision).delete()
    if free < need:
        raise JobError(f"{member.machine.name} has {disk.gb(free)} free in its store; {model} needs {disk.gb(need)}. "
                       "No model there can be removed to make room.", kind=ErrorKind.NO_ROOM)
    return f"{member.machine.name}: removed {', '.join(removed)} to make room"


# -- removing a model's files from machines ------------------------------------------------------


def files_forgotten(machine, model: StoredModel) -> None:
    """The machine's agent removed the model (and the files no other model there uses): its transfers of
    those files are forgotten too, so that the next copy sends them again instead of taking them as held."""
    others = ModelHolding.objects.filter(machine=machine).exclude(model=model).values_list("model_id", flat=True)
    still_used = set(StoredModel.objects.filter(pk__in=list(others)).values_list("files__sha256", flat=True))
    gone = set(model.files.values_list("sha256", flat=True)) - still_used
    Transfer.objects.filter(member__machine=machine, digest__in=gone).delete()


REMOVE_KIND = "model.remove"
REMOVE_FILES = Step("Remove the files from the machines")
REMOVE = Operation(REMOVE_KIND, (REMOVE_FILES,))


def model_remove_run(ctx: JobContext, *, model_id: int, machine_ids: list[int]) -> None:
    """Remove the model's files from those machines (its other models' files stay)."""
    model = StoredModel.objects.get(pk=model_id)
    holdings = list(model.holdings.select_related("machine").filter(machine_id__in=machine_ids))
    REMOVE_FILES.always(ctx, ", ".join(h.machine.name for h in holdings))
    failures = []
    for holding in holdings:
        try:
            with Agent.open(holding.machine) as agent:
                freed = agent.model_remove(repo=model.repo, revision=model.commit)
        except AgentError as exc:
            failures.append(f"{holding.machine.name}: {exc.message}")
            continue
        files_forgotten(holding.machine, model)
        holding.delete()
        ctx.log(f"{holding.machine.name}: {disk.gb(freed)} freed")
    downloads.model_changed(model)
    if failures:
        raise JobError("; ".join(failures))

