"""What a person needs to reach a cluster and run their own jobs on it: every node's place, the
hostfile, each node's ``cluster.env``, the ``/etc/hosts`` lines and the commands the Connect card shows.

Everything here is pure (plain data in, text out) except ``nodes_of``, the one function that reads
the database. Nothing is written, nothing is run: the services put the files on the machines, the
pages and the API show the commands (``connection_info.py`` adds the settings and the person).
Every value that goes into a shell command passes through ``shlex.quote``; the hostfile and
``/etc/hosts`` are not shell, so the values they hold are checked when a ``Node`` is made (an IP
address, an interface name without blanks or commas).
"""
from __future__ import annotations

import ipaddress
import json
import re
import shlex
from dataclasses import dataclass, field

from django.db.models import Prefetch

from clusters import hooks
from clusters.choices import Role
from clusters.models import ClusterMember
from machines.models import Accelerator, NetworkInterface

ETC = "/etc/fadenstack"
HOSTFILE_PATH = f"{ETC}/hostfile"
ENV_PATH = f"{ETC}/cluster.env"
MASTER_PORT = 29500  # torch.distributed's default port: what MASTER_PORT says on every node
RAY_DASHBOARD_PORT = 8265  # Ray's dashboard and job API: on the head's loopback only
RAY_CLIENT_PORT = 10001  # Ray Client (ray://), the default of ``ray start --ray-client-server-port``
NODE_LOGIN_USER = "root"  # a node login is root on that machine (issue 13)
DEFAULT_SCRIPT = "train.py"
HOSTS_BEGIN = "# fadenstack cluster nodes: begin"
HOSTS_END = "# fadenstack cluster nodes: end"

# Linux allows up to 15 characters (IFNAMSIZ - 1) and anything but '/' and blanks; a comma would split
# NCCL_SOCKET_IFNAME's list, so it is refused too. Whatever else a name holds is shell-quoted.
_BAD_IFNAME = re.compile(r"[\s/,\x00]")


class NotConnectable(ValueError):
    """A cluster whose nodes cannot be described yet (a member without an address on the cluster
    network, no head): the message is the sentence the card shows."""


def _ip(text: str, what: str) -> str:
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        raise NotConnectable(f"{what} is not an IP address: {text!r}.") from None


@dataclass(frozen=True)
class Node:
    """One machine of the cluster as launchers see it. ``rank`` 0 is the head; the others follow by
    machine name. ``interface`` is this machine's own name for its interface on the cluster network
    (``eth1`` here, ``ens5`` there), which is why NCCL's and Gloo's settings are per node.
    ``free_gpus``: the indices of its GPUs no copy of a model holds, which a person's own jobs may use
    (every one of its ``gpus`` when not given)."""

    rank: int
    machine: str  # the machine's name in the console: lab-a
    address: str  # its address on the cluster network
    interface: str
    gpus: int
    vendor: str = ""  # nvidia, amd; empty without accelerators
    ssh_address: str = ""  # where people reach it over SSH (the console's address for it); the cluster address if empty
    ssh_port: int = 22
    free_gpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "address", _ip(self.address, f"{self.machine}'s cluster address"))
        if not self.interface or len(self.interface) > 15 or _BAD_IFNAME.search(self.interface):
            raise NotConnectable(f"{self.machine}'s interface on the cluster network has a name Linux would not give: {self.interface!r}.")
        if self.rank < 0 or self.gpus < 0:
            raise NotConnectable(f"{self.machine}: rank and GPUs cannot be negative.")
        free = tuple(range(self.gpus)) if self.free_gpus is None else tuple(sorted(set(self.free_gpus)))
        if len(free) > self.gpus or any(type(i) is not int or i < 0 for i in free):
            raise NotConnectable(f"{self.machine}: its free GPUs {list(free)} are not among its {self.gpus}.")
        object.__setattr__(self, "free_gpus", free)
        if not 0 < self.ssh_port < 65536:
            raise NotConnectable(f"{self.machine}: {self.ssh_port} is not a TCP port.")
        if not self.ssh_address:
            object.__setattr__(self, "ssh_address", self.address)
        elif not self.ssh_address.strip() or any(c.isspace() for c in self.ssh_address):
            raise NotConnectable(f"{self.machine}'s SSH address has blanks in it: {self.ssh_address!r}.")

    @property
    def name(self) -> str:
        """The name the nodes use for each other (``ssh node-1``), from ``/etc/hosts``."""
        return f"node-{self.rank}"

    @property
    def free_gpus_text(self) -> str:
        """``0,1,2,3``: the free GPUs as ``CUDA_VISIBLE_DEVICES`` takes them; empty when copies hold them all."""
        return ",".join(str(i) for i in self.free_gpus)


@dataclass(frozen=True)
class ClusterNet:
    """The cluster as launchers see it: its name, its network and where the rendezvous is."""

    name: str
    network: str  # CIDR
    head_address: str
    master_port: int = MASTER_PORT

    @classmethod
    def of(cls, name: str, network: str, nodes: list[Node] | tuple[Node, ...], master_port: int = MASTER_PORT) -> "ClusterNet":
        """The cluster's part of the plan, the head read from the nodes (rank 0)."""
        head = _ordered(nodes)[0]
        try:
            network = str(ipaddress.ip_network(network.strip(), strict=False))
        except ValueError:
            raise NotConnectable(f"The cluster's network is not a subnet: {network!r}.") from None
        return cls(name=name, network=network, head_address=head.address, master_port=master_port)


def _ordered(nodes) -> list[Node]:
    """The nodes by rank, checked: ranks 0..n-1, each once (a hole would give torchrun a wrong world)."""
    ordered = sorted(nodes, key=lambda n: n.rank)
    if not ordered:
        raise NotConnectable("The cluster has no machines.")
    if [n.rank for n in ordered] != list(range(len(ordered))):
        raise NotConnectable(f"Node ranks must be 0 to {len(ordered) - 1}, each once: got {[n.rank for n in ordered]}.")
    return ordered


# ------------------------------------------------------------------ from the database


def nodes_of(cluster) -> list[Node]:
    """The cluster's members as ``Node``s: the head is node 0, then the workers by machine name.
    Each node's interface is the one holding its cluster address (else the first one on the cluster
    network): machines name their interfaces differently, so it is looked up per machine. Its free GPUs
    are those no copy holds now (``hooks.gpus_held``: deployments answers)."""
    members = list(
        ClusterMember.objects.filter(cluster=cluster).select_related("machine").prefetch_related(
            Prefetch("machine__interfaces", queryset=NetworkInterface.objects.order_by("name")),
            Prefetch("machine__accelerators", queryset=Accelerator.objects.order_by("index")),
        )
    )
    heads = [m for m in members if m.role == Role.HEAD]
    if len(heads) != 1:
        raise NotConnectable(f"{cluster.name} has {len(heads)} heads; its nodes are numbered from the one head.")
    workers = sorted((m for m in members if m.role != Role.HEAD), key=lambda m: m.machine.name)
    network = _network(cluster.network)
    held = hooks.gpus_held(cluster)
    nodes = []
    for rank, member in enumerate([heads[0], *workers]):
        machine = member.machine
        if not member.address:
            raise NotConnectable(f"{machine.name} has no address on the cluster network yet.")
        accelerators = list(machine.accelerators.all())
        nodes.append(Node(
            rank=rank, machine=machine.name, address=member.address,
            interface=_interface_for(machine.name, member.address, network, machine.interfaces.all()),
            gpus=len(accelerators), vendor=accelerators[0].vendor if accelerators else "",
            ssh_address=machine.address, ssh_port=machine.ssh_port,
            free_gpus=tuple(a.index for a in accelerators if a.index not in held.get(machine.pk, ())),
        ))
    return nodes


def _network(text: str):
    try:
        return ipaddress.ip_network(text.strip(), strict=False) if text else None
    except ValueError:
        return None


def _interface_for(machine: str, address: str, network, interfaces) -> str:
    """The name of the machine's interface that carries ``address``; failing that, its first
    interface on ``network`` (the address was given without the agent reporting it yet)."""
    wanted = _ip(address, f"{machine}'s cluster address")
    on_network = None
    for iface in interfaces:
        for text in iface.addresses or ():
            try:
                interface = ipaddress.ip_interface(str(text).strip())
            except ValueError:
                continue  # the agent reported something that is not an address
            if str(interface.ip) == wanted:
                return iface.name
            if on_network is None and network is not None and interface.ip in network:
                on_network = iface.name
    if on_network:
        return on_network
    raise NotConnectable(f"{machine} has no interface with {address} (the cluster network {network or 'is not set'}).")


# ------------------------------------------------------------------ files on every node


def hostfile(nodes) -> str:
    """``/etc/fadenstack/hostfile``: ``<address> slots=<free GPUs>`` per node, head first: the GPUs no
    copy of a model holds, which a person's own jobs may use.

    The one form both read: Open MPI's hostfile takes ``host slots=N``, DeepSpeed's runner matches
    ``^(\\S+)\\s+slots=(\\d+)`` and refuses a host twice or any other line (comments aside). Addresses,
    not names, so the file works before ``/etc/hosts`` is written and from any shell. A node without
    free GPUs has no slot to give and is left out (DeepSpeed and mpirun would start nothing there anyway).
    """
    return "".join(f"{n.address} slots={len(n.free_gpus)}\n" for n in _ordered(nodes) if n.free_gpus)


def nccl_socket_ifname(interfaces: list[str]) -> str:
    """NCCL's value for these interface names, matched exactly: ``=eth1`` (plain ``eth1`` is a
    prefix and would also take ``eth10`` or the VLAN ``eth1.100``)."""
    return "=" + ",".join(dict.fromkeys(interfaces))


def cluster_env(nodes, node: Node, *, master_port: int = MASTER_PORT) -> str:
    """``/etc/fadenstack/cluster.env`` for ``node``: ``KEY=value`` lines, each value shell-quoted,
    read by every login shell with ``set -a; . /etc/fadenstack/cluster.env; set +a`` and by each
    launcher command below before it starts anything (commands over SSH start no login shell)."""
    ordered = _ordered(nodes)
    if node not in ordered:
        raise NotConnectable(f"{node.machine} is not one of the cluster's nodes.")
    values = {
        "MASTER_ADDR": ordered[0].address,
        "MASTER_PORT": str(master_port),
        "NODE_RANK": str(node.rank),
        "WORLD_NODES": str(len(ordered)),
        # What a launcher starts a process for: the GPUs no copy holds, and which ones they are.
        "GPUS_PER_NODE": str(len(node.free_gpus)),
        "FADEN_FREE_GPUS": node.free_gpus_text,
        "NCCL_SOCKET_IFNAME": nccl_socket_ifname([node.interface]),
        "GLOO_SOCKET_IFNAME": node.interface,  # Gloo takes the device's name itself
    }
    lines = ["# This node's place in its Fadenstack cluster. The console rewrites this file when machines join or leave.",
             "# FADEN_FREE_GPUS: the GPUs no copy of a model held when it was written; the Connect card lists them live."]
    lines += [f"{key}={shlex.quote(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def hosts_lines(nodes) -> str:
    """The block of ``/etc/hosts`` that names every node (``node-0`` ...) by its cluster address,
    between markers so that the next write replaces it whole."""
    body = [f"{n.address} {n.name}" for n in _ordered(nodes)]
    return "\n".join([HOSTS_BEGIN, *body, HOSTS_END]) + "\n"


# ------------------------------------------------------------------ the Connect card's commands


@dataclass(frozen=True)
class Snippets:
    """The commands the Connect card shows (and ``connection.snippets`` in the API), the cluster's
    own addresses filled in. ``ssh_commands`` is by node name."""

    ssh_commands: dict[str, str] = field(default_factory=dict)
    torchrun: str = ""  # from the head: starts ``torchrun_node`` on every node over the cluster's own SSH
    torchrun_node: str = ""  # the same command on every node
    mpirun: str = ""
    deepspeed: str = ""
    ray_job_submit: str = ""
    ray_tunnel: str = ""

    def as_dict(self) -> dict:
        return {
            "ssh_commands": dict(self.ssh_commands), "torchrun": self.torchrun, "torchrun_node": self.torchrun_node,
            "mpirun": self.mpirun, "deepspeed": self.deepspeed, "ray_job_submit": self.ray_job_submit,
            "ray_tunnel": self.ray_tunnel,
        }


def _ssh_options(node: Node, jump: str) -> list[str]:
    options = ["-J", shlex.quote(jump)] if jump else []
    if node.ssh_port != 22:
        options += ["-p", str(node.ssh_port)]
    return options


def ssh_command(node: Node, *, jump: str = "") -> str:
    """``ssh root@<address>`` for one node, through ``jump`` (``ProxyJump``) when the machines are
    not reachable from the person's computer."""
    return " ".join(["ssh", *_ssh_options(node, jump), shlex.quote(f"{NODE_LOGIN_USER}@{node.ssh_address}")])


def _load_env() -> str:
    # set -a exports what the file sets: NCCL and Gloo read their variables from the environment.
    return f"set -a; . {ENV_PATH}; set +a"


def _endpoint(net: ClusterNet) -> str:
    # torchrun reads [v6]:port for an IPv6 endpoint.
    return "[$MASTER_ADDR]:$MASTER_PORT" if ":" in net.head_address else "$MASTER_ADDR:$MASTER_PORT"


def torchrun_node(net: ClusterNet, *, script: str = DEFAULT_SCRIPT) -> str:
    """The command each node runs: its settings first, then torchrun with the c10d rendezvous at the
    head, which gives every node its rank (no ``--node-rank``: the same text on every node)."""
    return (
        f"{_load_env()}; CUDA_VISIBLE_DEVICES=$FADEN_FREE_GPUS torchrun --nnodes=$WORLD_NODES --nproc-per-node=$GPUS_PER_NODE"
        f" --rdzv-id={shlex.quote(net.name)} --rdzv-backend=c10d --rdzv-endpoint={_endpoint(net)}"
        f" {shlex.quote(script)}"
    )


def snippets(nodes, net: ClusterNet, *, jump: str = "", script: str = DEFAULT_SCRIPT) -> Snippets:
    """Every command of the Connect card. Flags are the tools' documented ones: torchrun's
    ``--nnodes``/``--nproc-per-node``/``--rdzv-*``; Open MPI's ``--hostfile``, ``-np``,
    ``--allow-run-as-root`` (node logins are root) and ``btl_tcp_if_include``, which takes a CIDR
    subnet (interface names differ per machine); DeepSpeed's ``--hostfile``/``--master_addr``/
    ``--master_port``; ``ray job submit --address`` and its ``--`` before the entrypoint."""
    ordered = _ordered(nodes)
    head = ordered[0]
    per_node = torchrun_node(net, script=script)
    names = " ".join(n.name for n in ordered)
    # mpirun starts one process per slot: each loads its own node's settings before the script, and sees
    # the node's free GPUs only (its local rank picks one of them).
    rank_body = f"{_load_env()}; CUDA_VISIBLE_DEVICES=$FADEN_FREE_GPUS exec python {shlex.quote(script)}"
    total_gpus = sum(len(n.free_gpus) for n in ordered)
    # DeepSpeed's runner exports the head's NCCL_* variables to every node, so the head's own
    # interface would be forced everywhere: give it every node's name instead (matched exactly).
    ifnames = nccl_socket_ifname([n.interface for n in ordered])
    # DeepSpeed gives each node GPUs 0..slots-1 unless told which: where copies hold some, name the free ones.
    include = ""
    if any(len(n.free_gpus) < n.gpus for n in ordered) and not any(":" in n.address for n in ordered):
        include = " --include " + shlex.quote("@".join(f"{n.address}:{n.free_gpus_text}" for n in ordered if n.free_gpus))
    # The cluster's Ray offers no GPUs (copies run on exactly the GPUs placement gives them), so a job asking
    # Ray for one waits for ever: the job runs on the head and is told the head's free GPUs instead. python3,
    # not python: the entrypoint runs in the runtime, whose images need not name Python without its version.
    runtime_env = json.dumps({"env_vars": {"CUDA_VISIBLE_DEVICES": head.free_gpus_text}})
    tunnel = ["ssh", "-N", "-L", f"{RAY_DASHBOARD_PORT}:127.0.0.1:{RAY_DASHBOARD_PORT}",
              "-L", f"{RAY_CLIENT_PORT}:127.0.0.1:{RAY_CLIENT_PORT}", *_ssh_options(head, jump),
              shlex.quote(f"{NODE_LOGIN_USER}@{head.ssh_address}")]
    return Snippets(
        ssh_commands={n.name: ssh_command(n, jump=jump) for n in ordered},
        torchrun=f"for node in {names}; do ssh \"$node\" {shlex.quote(per_node)} & done; wait",
        torchrun_node=per_node,
        mpirun=(f"mpirun --allow-run-as-root --hostfile {HOSTFILE_PATH} -np {total_gpus}"
                f" --mca btl_tcp_if_include {shlex.quote(net.network)} bash -c {shlex.quote(rank_body)}"),
        deepspeed=(f"NCCL_SOCKET_IFNAME={shlex.quote(ifnames)} deepspeed --hostfile {HOSTFILE_PATH}{include}"
                   f" --master_addr {shlex.quote(net.head_address)} --master_port {net.master_port} {shlex.quote(script)}"),
        ray_job_submit=(f"ray job submit --address http://127.0.0.1:{RAY_DASHBOARD_PORT} --working-dir ."
                        f" --runtime-env-json {shlex.quote(runtime_env)} -- python3 {shlex.quote(script)}"),
        ray_tunnel=" ".join(tunnel),
    )
