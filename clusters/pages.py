"""What the cluster pages show: the cards of a cluster's page, the list's rows, the network step,
and the live renders that push them. Views render these for a request; ``render_*_topic`` render
the same partials for a websocket push. Both render for a role: the buttons it may not press are
greyed out with the reason.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from django.template.loader import render_to_string

from clusters import actions, connection_info, encryption, hooks, nccl_card, nccl_tests, node_logins, planning, selectors
from clusters.choices import MemberState, Role
from clusters.models import Cluster, ClusterMember, HealthCheck, NetworkMeasurement
from clusters.shared_files import shared_sentence
from clusters.wiring import wiring_diagram
from console import roles
from console.models import Job
from machines import ssh_rules


def cluster_cards(cluster: Cluster, members: list[ClusterMember] | None = None, *, role: roles.Role | None,
                  status: bool = True) -> dict:
    """The header, the summary, the member table and the operation card, for ``role`` (``status``: load
    the members' last status, which only the wiring card shows)."""
    members = selectors.cluster_members(cluster, status=status) if members is None else members
    # The card shows the job's steps, not its log.
    jobs = list(Job.objects.filter(target_type="cluster", target_id=cluster.pk).defer("log", "params")[:1])
    busy = selectors.cluster_busy(cluster)
    joined = [m for m in members if m.state == MemberState.JOINED]
    return {
        "cluster": cluster,
        "members": members,
        "job": jobs[0] if jobs else None,
        "busy": busy,
        "role": role,
        "actions": actions.cluster_actions(cluster, busy, role=role) | actions.page_flags(cluster),
        "head": next((m for m in members if m.role == Role.HEAD), None),
        "summary": {
            "machines_up": len(joined),
            "machines": len(members),
            "accelerators": sum(m.accelerators_in_ray for m in joined),
            "free_accelerators": hooks.accelerators_free(cluster, joined),
        },
    } | extra_cards(cluster, role)


@dataclass(frozen=True)
class TransferBar:
    """One bar of a machine's row: the files on their way to it that make one thing (a model's files
    travel one by one, and the row shows the model)."""

    what: str
    source: str
    bytes_done: int
    bytes_total: int
    rate: float

    @property
    def percent(self) -> int:
        return int(100 * self.bytes_done / self.bytes_total) if self.bytes_total else 0


def transfer_bars(transfers) -> list[TransferBar]:
    bars: dict[str, list] = {}
    for t in transfers:
        bars.setdefault(t.what, []).append(t)
    return [TransferBar(what=what, source=group[-1].source, bytes_done=sum(t.bytes_done for t in group),
                        bytes_total=sum(t.bytes_total for t in group), rate=sum(t.rate for t in group if not t.complete))
            for what, group in bars.items()]


def _short_digest(digest: str | None) -> str:
    return (digest or "").removeprefix("sha256:")[:12]


def _measured_links(cluster: Cluster, head: ClusterMember | None) -> dict[int, NetworkMeasurement]:
    """The last bandwidth test from the head to each machine on the cluster's own network."""
    if head is None or not cluster.network:
        return {}
    rows = NetworkMeasurement.objects.filter(subnet=cluster.network, source_id=head.machine_id)
    return {row.target_id: row for row in rows}


def _member_view(cluster: Cluster, m: ClusterMember, link: NetworkMeasurement | None, count: int, busy: Job | None,
                 accelerators: str, role: roles.Role | None, note: dict | None = None) -> dict:
    """One machine's box in the diagram, its panel and its row: every value the template shows,
    worked out once here rather than looked up again in each of the template's loops."""
    status = m.last_status or {}
    runtime = status.get("runtime") or {}
    ray_node = status.get("ray_node") or {}
    transfers = transfer_bars(m.transfers.all())
    return {
        "m": m,
        "member_pk": m.pk,
        "id": m.machine_id,
        "name": m.machine.name,
        "url": m.machine.get_absolute_url(),
        "is_head": m.role == Role.HEAD,
        "joined": m.state == MemberState.JOINED,
        "in_ray": m.accelerators_in_ray,
        "state_label": m.get_state_display(),
        "badge": m.badge,
        "reason": m.state_reason,
        "address": m.address,
        "image": str(m.runtime_image) if m.runtime_image else "",
        "transfers": transfers,
        "several_transfers": len(transfers) > 1,
        "accelerators": accelerators,
        "runtime": runtime,
        "ray": runtime.get("ray") or {},
        "ray_node": ray_node,
        "error": status.get("error", ""),
        "running_digest": _short_digest(runtime.get("digest")),
        "image_digest": _short_digest(m.runtime_image.digest) if m.runtime_image else "",
        "node_id": ray_node.get("node_id") or m.ray_node_id,
        "link": link,
        "remove": actions.member_remove(cluster, m, count=count, busy=busy, role=role),
        "drain": actions.member_drain(cluster, m),
        "note": note,  # an app's word on the machine beside its state (deployments: its drain)
    }


def wiring_card(cluster: Cluster, cards: dict, selected: int | None = None) -> dict:
    """How this cluster is wired: the diagram, the member table and, for each machine, the panel that
    opens when it is selected."""
    members = cards["members"]
    links = _measured_links(cluster, cards["head"])
    summaries = selectors.accelerator_summaries(m.machine_id for m in members)
    notes = hooks.machine_notes(cluster)
    views = [_member_view(cluster, m, links.get(m.machine_id) if m.role != Role.HEAD else None, len(members), cards["busy"],
                          summaries.get(m.machine_id, ""), cards["role"], notes.get(m.machine_id)) for m in members]
    if selected not in {m.machine_id for m in members}:
        selected = None
    return {"member_views": views, "diagram": wiring_diagram(views), "selected": selected}


def checks_card(cluster: Cluster) -> dict:
    """The health checks the server ran, and the raw status they last read."""
    return {
        "checks": list(HealthCheck.objects.filter(cluster=cluster)[:20]),
        "raw_status": json.dumps(cluster.last_status, indent=2, sort_keys=True) if cluster.last_status else "",
    }


def runtime_card(cluster: Cluster, members: list[ClusterMember] | None = None) -> dict:
    offer = [{**entry, "digest": _short_digest(entry["image"].digest),
              "machines_text": ", ".join(entry["machines"][:6]) + (f" and {len(entry['machines']) - 6} more" if len(entry["machines"]) > 6 else "")}
             for entry in selectors.runtime_offer(cluster, members)]
    return {"runtime_offer": offer, "runtime_newer": [e for e in offer if e["newer"]]}


# The Connect card's commands, in the order it shows them: (snippet, title, what it does).
CONNECT_BLOCKS = (
    ("torchrun", "torchrun", "From the head: starts the same command on every node over the cluster's own SSH; each "
                             "node loads its settings first, and the rendezvous gives every node its rank."),
    ("torchrun_node", "torchrun on one node", "Or run this on each node yourself, in any order."),
    ("mpirun", "mpirun", "From the head: one process per free GPU across the hostfile, each with its own node's settings."),
    ("deepspeed", "DeepSpeed", "From the head, with the same hostfile; DeepSpeed reaches every node over SSH (pdsh)."),
    ("ray_tunnel", "Ray tunnel", "On your computer: Ray's dashboard and job API (8265) and Ray Client (10001) on the "
                                 "head's loopback, forwarded over SSH."),
    ("ray_job_submit", "ray job submit", "On your computer, while the tunnel is open. The cluster's Ray offers no GPUs "
                                         "(copies of models run on exactly the GPUs the console gives them), so a job that "
                                         "asks Ray for one waits for ever: this one runs on the head and finds the head's "
                                         "free GPUs in CUDA_VISIBLE_DEVICES."),
)


def connect_card(cluster: Cluster, role: roles.Role | None) -> dict:
    """The Connect card: every node with its ssh command and every launcher's command, once every machine
    is Up; until then the machine it waits for. The certificate button is for the roles a node login
    may be for (Administrators, and Operators: whether this one was allowed is the certificate page's
    to say, since the card is pushed to a role, not to a person); a Viewer does not see it."""
    try:
        reach = connection_info.connection_of(cluster)
    except connection_info.NotConnectable as waiting:
        return {"connect": {"waiting": str(waiting), "cluster_name": cluster.name}}
    summaries = selectors.accelerator_summaries(reach.machine_ids.values())
    commands = reach.snippets.ssh_commands
    rows = [{"node": n, "machine_id": reach.machine_ids[n.machine], "ssh": commands[n.name], "host_key": reach.host_keys[n.machine],
             "gpus": summaries.get(reach.machine_ids[n.machine], "") or n.gpus} for n in reach.nodes]
    blocks = [{"id": key, "title": title, "text": text, "command": getattr(reach.snippets, key)} for key, title, text in CONNECT_BLOCKS]
    sign = ssh_rules.node_login_offer(role=role, allowed=True)
    return {"connect": {"reach": reach, "rows": rows, "blocks": blocks, "jump": reach.jump, "cluster_name": cluster.name,
                        "faden_ssh": f"faden ssh {cluster.name} {reach.nodes[-1].name}", "sign": sign.ok,
                        "valid_for": connection_info.validity_words(),
                        "shared": shared_sentence(cluster.shared_files, head_node=reach.nodes[0].name, nodes=len(reach.nodes),
                                                  node_of={n.machine: n.name for n in reach.nodes})}}


def render_connect_card(page: dict) -> str:
    """The card pushed beside the members (a machine Up) and the whole page (the cluster Running), from
    the context the page's push renders already (``connect_card`` ran once, through ``extra_cards``)."""
    return render_to_string("clusters/_connect_card.html",
                            {"cluster": page["cluster"], "role": page["role"], "connect": page["connect"], "oob": True})


def page_cards() -> list[hooks.PageCard]:
    """The cards below the cluster's members: its own first (the connection, the NCCL test), then those of
    the apps above (deployments' models, say)."""
    return [hooks.PageCard("connect", template="clusters/_connect_card.html", context=connect_card),
            hooks.PageCard(nccl_tests.LIVE_PART, template="clusters/_nccl_card.html", context=nccl_card.nccl_card),
            hooks.PageCard(node_logins.LIVE_PART, template="clusters/_node_logins_card.html", context=node_logins.node_logins_card),
            *hooks.extension_cards()]


def extra_cards(cluster: Cluster, role: roles.Role | None) -> dict:
    """The cards of ``page_cards``, with their context for ``role`` merged in."""
    context: dict = {"extra_cards": []}
    for card in page_cards():
        context |= card.context(cluster, role)
        context["extra_cards"].append(card.template)
    return context


def cluster_page(cluster: Cluster, selected: int | None = None, *, role: roles.Role | None) -> dict:
    cards = cluster_cards(cluster, role=role)
    return (cards | wiring_card(cluster, cards, selected) | checks_card(cluster) | runtime_card(cluster, cards["members"])
            | encryption.encryption_card(cluster, role))


def render_encryption_card(cluster: Cluster, role: roles.Role | None) -> str:
    """The encryption card alone: its own part, and beside the job's (a start issues certificates)."""
    return render_to_string("clusters/_encryption_card.html", {"cluster": cluster, "role": role, "oob": True}
                            | encryption.encryption_card(cluster, role))


def render_cluster_topic(arg: str, part: str, role: roles.Role) -> list[str]:
    # The raw status is shown by the whole page and the checks part only.
    clusters = Cluster.objects.all() if part in ("", "checks") else Cluster.objects.defer("last_status")
    cluster = clusters.filter(pk=int(arg)).first()
    if cluster is None:
        return [render_to_string("clusters/cluster_detail.html#deleted", {"oob": True})]
    if part == "members":
        cards = cluster_cards(cluster, role=role)
        # One message with the card: it appears in the same swap as the last machine turning Up.
        return [render_to_string("clusters/cluster_detail.html#members-live", cards | wiring_card(cluster, cards) | {"oob": True})
                + render_connect_card(cards) + nccl_card.render_nccl_card(cards)]
    if part == "job":
        cards = cluster_cards(cluster, role=role, status=False)
        return [render_to_string("clusters/cluster_detail.html#job-live", cards | runtime_card(cluster, cards["members"]) | {"oob": True})
                + render_encryption_card(cluster, role)]
    if part == "encryption":
        return [render_encryption_card(cluster, role)]
    if part == "checks":
        return [render_to_string("clusters/cluster_detail.html#checks-live",
                                 cluster_cards(cluster, role=role, status=False) | checks_card(cluster) | {"oob": True})]
    if (card := next((c for c in page_cards() if c.name == part), None)) is not None:  # a card alone (the NCCL test's, after each size)
        return [render_to_string(card.template, {"cluster": cluster, "role": role, "oob": True} | card.context(cluster, role))]
    page = cluster_page(cluster, role=role)
    return [render_to_string("clusters/cluster_detail.html#live", page | {"oob": True}) + render_connect_card(page)
            + nccl_card.render_nccl_card(page) + render_encryption_card(cluster, role)]


# -- the list -------------------------------------------------------------------------------------


def render_clusters_topic(arg: str, part: str, role: roles.Role) -> list[str]:
    # The whole body, whatever changed: it is a handful of rows, and so a new cluster appears and a
    # deleted one goes without the page knowing which rows it holds. The rows hold no buttons.
    return [render_to_string("clusters/cluster_list.html#rows", {"clusters": selectors.clusters_with_totals(), "oob": True})]


# -- the network step (the wizard's, and a cluster's Change the network) ----------------------------


def network_view(state, probe_job: Job | None = None, picked: list[planning.Candidate] | None = None) -> dict:
    """The shared networks with their marks, the measured figures and the suggestion (``picked``: the
    machines of ``state["picked"]`` when the caller has them already)."""
    picked = selectors.candidates(state["picked"]) if picked is None else picked
    networks = planning.shared_networks(picked)
    others = [c.id for c in picked if c.id != state["head"]]
    measured = selectors.measurements([n.subnet for n in networks], state["head"], others) if others else {}
    suggested = planning.suggest_network(networks, measured)
    names = {c.id: c.name for c in picked}
    failures = {}
    if others:
        for row in NetworkMeasurement.objects.filter(subnet__in=[n.subnet for n in networks], source_id=state["head"],
                                                     target_id__in=others).exclude(error=""):
            failures.setdefault(row.subnet, []).append(f"{names.get(row.target_id, '?')}: {row.error}")
    return {
        "networks": [{"net": n, "measured": measured.get(n.subnet), "failures": failures.get(n.subnet, []),
                      "members": [{"name": names[m.machine_id], "member": m} for m in n.members]} for n in networks],
        "suggested": suggested,
        "chosen": state["network"] if any(n.subnet == state["network"] for n in networks) else suggested,
        "probe_job": probe_job,
        "no_network": not networks,
        "no_network_message": planning.NO_SHARED_NETWORK,
        "needs_test": len(picked) > 1,
    }


def cluster_network_view(cluster: Cluster, probe_job: Job | None = None, chosen: str = "") -> dict:
    """The networks the cluster's machines share, measured from its head: the wizard's step, for a running cluster."""
    members = list(cluster.members.order_by("machine__name").values_list("machine_id", "role"))
    head = next((machine_id for machine_id, role in members if role == Role.HEAD), None)
    state = {"picked": [machine_id for machine_id, _ in members], "head": head, "network": chosen or cluster.network}
    context = network_view(state, probe_job)
    return context | {"cluster": cluster, "current": cluster.network, "can_test": len(members) > 1 and head is not None}


def network_offers(role: roles.Role | None) -> dict:
    """The network step's buttons: test the networks, and (the wizard's) create the cluster."""
    return {"test": actions.TEST_NETWORKS.offer(role), "create": actions.CREATE.offer(role)}


def render_probe_topic(arg: str, part: str, role: roles.Role) -> list[str]:
    job = selectors.probe_job(int(arg))
    if job is None:
        return []
    state = {"picked": job.params["machines"], "head": job.params["head"], "network": "", "probe": job.pk}
    context = network_view(state, job) | network_offers(role) | {"oob": True, "wizard": state}
    messages_out = [render_to_string("clusters/wizard.html#networks", context)]
    # The same test runs from a cluster's Change the network page: that page's table gets the results too
    # (a page without the element ignores it).
    led = (ClusterMember.objects.select_related("cluster").defer("last_status", "cluster__last_status")
           .filter(machine_id=job.params["head"], role=Role.HEAD).first())
    if led is not None:
        cluster = led.cluster
        messages_out.append(render_to_string("clusters/cluster_network.html#networks",
                                             cluster_cards(cluster, role=role, status=False) | cluster_network_view(cluster, job)
                                             | network_offers(role) | {"oob": True}))
    return messages_out

