"""What a person connecting to a running lab cluster meets (issue 13), checked on the machines themselves:
each node's hostfile and login settings, logins with a certificate the console signs (and refused with
an expired one), root's SSH from node to node (and refused from another network), and a rendezvous at
MASTER_ADDR:MASTER_PORT that every node's script reaches from the head.

The test of a running cluster calls these after its own checks, so no cluster is started for them.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from clusters import connection_texts
from machines import remote, ssh_ca, sshd
from machines.agent_client import Agent
from machines.models import Machine
from machines.services import machine_target

FADEN = Path(sys.executable).with_name("faden")
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "IdentitiesOnly=yes"]

# Every node: connect to MASTER_ADDR:MASTER_PORT (node 0 listens there) and say its NODE_RANK; node 0
# answers each with the ranks it saw, in order, once all WORLD_NODES have come.
RENDEZVOUS = r"""
import os, socket, time
rank, world = int(os.environ["NODE_RANK"]), int(os.environ["WORLD_NODES"])
where = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
if rank == 0:
    server = socket.create_server(where)
    server.settimeout(60)
    peers = [server.accept()[0] for _ in range(world - 1)]
    ranks = sorted([0] + [int(p.recv(16)) for p in peers])
    for p in peers:
        p.sendall(repr(ranks).encode())
        p.close()
    print(rank, ranks)
else:
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = socket.create_connection(where, timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.sendall(str(rank).encode())
    print(rank, conn.recv(64).decode())
"""


def on(machine: Machine, command: str, *, timeout: float = 60) -> str:
    """``command`` in a root login shell on ``machine`` (over the console's own SSH); its output."""
    with remote.connect(machine_target(machine)) as conn:
        done = remote.run(conn, ["bash", "-lc", command], timeout=timeout)
    assert done.exit_status == 0, f"{machine.name}: {command!r} ended {done.exit_status}: {done.stdout[-500:]} {done.stderr[-500:]}"
    return done.stdout


def check_node_settings(cluster) -> list[connection_texts.Node]:
    """Every node's hostfile lists every node with its GPUs, head first, and its login shell has the
    cluster's settings with its own rank and its own interface on the cluster network."""
    nodes = connection_texts.nodes_of(cluster)
    expected_hostfile = connection_texts.hostfile(nodes)
    for node in nodes:
        machine = Machine.objects.get(name=node.machine)
        shown = on(machine, "cat /etc/fadenstack/hostfile; echo ---; env")
        hostfile, env_text = shown.split("---\n", 1)
        env = dict(line.split("=", 1) for line in env_text.splitlines() if "=" in line)
        assert hostfile == expected_hostfile, node.machine
        assert env["MASTER_ADDR"] == nodes[0].address and env["MASTER_PORT"] == "29500"
        assert (env["NODE_RANK"], env["WORLD_NODES"]) == (str(node.rank), str(len(nodes)))
        assert env["NCCL_SOCKET_IFNAME"] == f"={node.interface}" and env["GLOO_SOCKET_IFNAME"] == node.interface
        assert env["GPUS_PER_NODE"] == str(len(node.free_gpus)) and env["FADEN_FREE_GPUS"] == node.free_gpus_text
    return nodes


def user_key(home: Path) -> Path:
    """A person's computer: a home with an ed25519 key and nothing else in ~/.ssh."""
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700, parents=True)
    key = ssh / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ada@laptop", "-f", str(key)], check=True)
    return key


def known_host(home: Path, machine: Machine) -> None:
    """What the person said yes to on first login: the machine's host key, as the console pinned it."""
    with Agent.open(machine) as agent:  # the connection checks the key against the pinned fingerprint
        key = agent.host_key()
    host = machine.address if machine.ssh_port == 22 else f"[{machine.address}]:{machine.ssh_port}"
    with (home / ".ssh" / "known_hosts").open("a") as fh:
        fh.write(f"{host} {key}\n")


def check_certificate_logins(cluster, node: connection_texts.Node, *, console_url: str, token: str, home: Path) -> None:
    """``faden ssh CLUSTER node-N`` logs in to that node with a certificate signed for the person's key,
    no key of theirs on the machine; the same key with an expired certificate is refused."""
    machine = Machine.objects.get(name=node.machine)
    key = user_key(home)
    known_host(home, machine)
    # OpenSSH reads ~/.ssh of the account, not of $HOME: an ssh first on PATH points it at this home's known_hosts.
    wrapper = home / "bin" / "ssh"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -o UserKnownHostsFile={home / '.ssh' / 'known_hosts'} \"$@\"\n")
    wrapper.chmod(0o755)
    env = {**os.environ, "HOME": str(home), "PATH": f"{wrapper.parent}:{os.environ['PATH']}", "FADEN_URL": console_url,
           "FADEN_TOKEN": token}
    logged_in = subprocess.run([str(FADEN), "ssh", cluster.name, node.name, "--", "bash -lc 'hostname; echo $NODE_RANK'"],
                               env=env, capture_output=True, text=True, timeout=60)
    assert logged_in.returncode == 0, logged_in.stderr
    assert logged_in.stdout.split() == [node.machine, str(node.rank)]
    assert "Certificate fadenstack:" in logged_in.stderr
    public = key.with_name("id_ed25519.pub").read_text().split()[1]
    assert public not in on(machine, "cat /root/.ssh/authorized_keys /run/fadenstack-lab/ssh/authorized_keys 2>/dev/null; true")
    check_taken_back(cluster, machine, key, home=home)

    expired = home / "expired-cert.pub"
    expired.write_text(ssh_ca.certificate_for(key.with_name("id_ed25519.pub").read_text(), principals=sshd.login_principals(cluster_id=cluster.pk),
                                              key_id="fadenstack:ada:expired:1", valid_seconds=1, serial=2**40) + "\n")
    time.sleep(1.5)  # the certificate's one second passes
    refused = subprocess.run(["ssh", *SSH_OPTIONS, "-i", str(key), "-o", f"CertificateFile={expired}",
                              "-o", f"UserKnownHostsFile={home / '.ssh' / 'known_hosts'}", "-p", str(machine.ssh_port),
                              f"root@{machine.address}", "true"], env={**os.environ, "HOME": str(home)},
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused.stderr


def _login(machine: Machine, key: Path, certificate: Path, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", *SSH_OPTIONS, "-i", str(key), "-o", f"CertificateFile={certificate}",
                           "-o", f"UserKnownHostsFile={home / '.ssh' / 'known_hosts'}", "-p", str(machine.ssh_port),
                           f"root@{machine.address}", "true"], env={**os.environ, "HOME": str(home)},
                          capture_output=True, text=True, timeout=30)


def check_taken_back(cluster, machine: Machine, key: Path, *, home: Path) -> float:
    """A certificate signed for a node login is listed for the cluster; an Administrator takes it back, and the
    node refuses it within a minute (the seconds are printed: the revocation list's way to the nodes)."""
    from clusters import node_logins
    from clusters.connection_info import node_login_certificate
    from clusters.models import NodeCertificate
    from tests.factories import UserFactory

    admin = UserFactory(username="root-admin")
    issued = node_login_certificate(user=admin, cluster=cluster, public_key=key.with_name("id_ed25519.pub").read_text()).issued
    certificate = home / "taken-back-cert.pub"
    certificate.write_text(issued.certificate + "\n")
    assert NodeCertificate.objects.filter(cluster=cluster, certificate_id=issued.serial).exists()
    assert _login(machine, key, certificate, home).returncode == 0
    on(machine, "test -s /etc/fadenstack/ssh/revoked.krl && grep -q '^RevokedKeys' /etc/ssh/sshd_config.d/fadenstack-ca.conf")

    taken = time.monotonic()
    node_logins.node_login_revoke(cluster=cluster, serial=issued.serial, user=admin)
    while (refused := _login(machine, key, certificate, home)).returncode == 0 and time.monotonic() - taken < 60:
        time.sleep(0.5)
    seconds = time.monotonic() - taken
    assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused.stderr
    print(f"\nA revoked node-login certificate was refused {seconds:.1f} s after it was taken back.")
    assert seconds < 60
    return seconds


def check_node_to_node(cluster, nodes: list[connection_texts.Node], *, home: Path) -> None:
    """Root on the head reaches every node by name without a password; the cluster's key is refused
    from the lab host's own network (only the cluster network may use it); a script on every node,
    started from the head over the cluster's own SSH, rendezvous at MASTER_ADDR:MASTER_PORT and every
    node agrees on the ranks."""
    head = Machine.objects.get(name=nodes[0].machine)
    names = on(head, " ; ".join(f"ssh -o BatchMode=yes {n.name} hostname" for n in nodes)).split()
    assert names == [n.machine for n in nodes]

    private = home / "cluster-key"
    private.write_text(on(head, "cat /root/.ssh/fadenstack_cluster"))
    private.chmod(0o600)
    other = Machine.objects.get(name=nodes[-1].machine)
    from_outside = subprocess.run(["ssh", *SSH_OPTIONS, "-i", str(private), "-o", "StrictHostKeyChecking=no",
                                   "-o", "UserKnownHostsFile=/dev/null", "-p", str(other.ssh_port), f"root@{other.address}", "true"],
                                  env={**os.environ, "HOME": str(home)}, capture_output=True, text=True, timeout=30)
    assert from_outside.returncode == 255 and "Permission denied" in from_outside.stderr, from_outside.stderr

    # ssh hands its words to the node's shell as one line: the command is quoted for that shell, then for the head's.
    remote_command = f"bash -lc {shlex.quote('python3 -c ' + shlex.quote(RENDEZVOUS))}"
    launch = " ".join(f"ssh -o BatchMode=yes {n.name} {shlex.quote(remote_command)} &" for n in nodes) + " wait"
    said = sorted(on(head, launch, timeout=90).splitlines())
    everyone = str(list(range(len(nodes))))
    assert said == sorted(f"{n.rank} {everyone}" for n in nodes)


def job_log(test: dict) -> str:
    from console.models import Job

    return Job.objects.get(pk=test["job"]).log


def check_nccl_test_on_the_link(test: dict, *, rate_mbit: int, max_bytes: int) -> dict:
    """The test as the API gives it: every size from 1 MiB to ``max_bytes``, doubling, its peak bus
    bandwidth at least 80 % of what each machine's shaped link carries (the all-reduce really went over
    the cluster network) and no faster than it."""
    assert test["state"] == "finished", test["message"]
    sizes = [row["size_bytes"] for row in test["rows"]]
    assert sizes[0] == 2**20 and sizes[-1] == max_bytes and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    link_gb_s = rate_mbit * 1e6 / 8 / 1e9
    assert test["peak"]["busbw"] >= 0.8 * link_gb_s, (test["peak"], link_gb_s)
    assert test["peak"]["busbw"] <= 1.05 * link_gb_s, "faster than the link: the bytes did not all cross it"
    return test


def check_nccl_test_stops_on_a_slow_link(test: dict, names: tuple[str, str]) -> dict:
    """On a 40 Mbit/s link the rest would take past the limit: stopped after 5 sizes, and says so."""
    assert test["state"] == "stopped" and len(test["rows"]) == 5, (test["state"], test["message"], test["rows"], job_log(test))
    assert test["message"].startswith(f"stopped after 5 sizes: the link between {names[0]} and {names[1]} would take"), test["message"]
    return test


def check_ray_job_through_the_tunnel(cluster, *, console_url: str, token: str, home: Path, port: int = 18265) -> str:
    """``faden clusters tunnel NAME`` forwards the head's Ray dashboard and job API (on its loopback only)
    to this computer with a fresh certificate; the Connect card's ``ray job submit`` through it runs a job on
    the cluster, told the head's free GPUs, and its result comes back; Ctrl-C ends the tunnel and its
    certificate goes."""
    known_host(home, Machine.objects.get(name=connection_texts.nodes_of(cluster)[0].machine))  # the person said yes to the head too
    env = {**os.environ, "HOME": str(home), "PATH": f"{home / 'bin'}:{os.environ['PATH']}", "FADEN_URL": console_url,
           "FADEN_TOKEN": token, "XDG_RUNTIME_DIR": str(home / "run")}
    (home / "run").mkdir(mode=0o700, exist_ok=True)
    tunnel = subprocess.Popen([str(FADEN), "clusters", "tunnel", cluster.name, "--local-port", str(port),
                               "--client-port", str(port + 1)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            probe = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{port}/api/version"], capture_output=True, text=True)
            if probe.returncode == 0:
                break
            if tunnel.poll() is not None:
                raise AssertionError(f"the tunnel ended ({tunnel.returncode}): {tunnel.stdout.read()}")
            assert time.monotonic() < deadline, f"no answer through the tunnel: {probe.stderr}"
            time.sleep(0.5)
        # The Connect card's own command, through this tunnel's port: the cluster's Ray offers no GPUs, and the
        # job (run on the head) finds the head's free GPUs in CUDA_VISIBLE_DEVICES.
        nodes = connection_texts.nodes_of(cluster)
        card = connection_texts.snippets(nodes, connection_texts.ClusterNet.of(cluster.name, cluster.network, nodes)).ray_job_submit
        argv = [word.replace(f":{connection_texts.RAY_DASHBOARD_PORT}", f":{port}") for word in shlex.split(card)]
        argv[0] = str(Path(sys.executable).with_name("ray"))
        job_dir = home / "job"
        job_dir.mkdir(exist_ok=True)
        (job_dir / "train.py").write_text("import os, socket\n"
                                          "print('answer', 6 * 7, 'from', socket.gethostname(), 'gpus', os.environ['CUDA_VISIBLE_DEVICES'])\n")
        job = subprocess.run(argv, cwd=job_dir, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, capture_output=True,
                             text=True, timeout=120)
        assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
        assert f"answer 42 from {nodes[0].machine} gpus {nodes[0].free_gpus_text}" in job.stdout, job.stdout[-2000:]
    finally:
        tunnel.send_signal(2)
        said = tunnel.communicate(timeout=30)[0]
    assert not list((home / "run").rglob("*-cert.pub")), "the tunnel's certificate outlived it"
    return said


def check_shared_files(cluster, nodes: list[connection_texts.Node]) -> None:
    """``/shared`` is the head's, mounted on every other node over the cluster network: a file written
    on the last node is read on every node, one the head writes is read on the last, and the hostfile is
    there too; the card says which file system carries it."""
    last = Machine.objects.get(name=nodes[-1].machine)
    head = Machine.objects.get(name=nodes[0].machine)
    stamp = f"{cluster.name}-{time.time_ns()}"
    on(last, f"echo from-{nodes[-1].name} > /shared/{stamp}-a")
    on(head, f"echo from-{nodes[0].name} > /shared/{stamp}-b")
    for node in nodes:
        machine = Machine.objects.get(name=node.machine)
        seen = on(machine, f"cat /shared/{stamp}-a /shared/{stamp}-b; echo ---; cat /shared/hostfile")
        files, hostfile = seen.split("---\n", 1)
        assert files.split() == [f"from-{nodes[-1].name}", f"from-{nodes[0].name}"], node.machine
        assert hostfile == connection_texts.hostfile(nodes), node.machine
    mounted = on(last, "findmnt -n -o FSTYPE,SOURCE,OPTIONS /shared").splitlines()[-1].split()  # the top one (the lab binds below it)
    assert mounted[0] in ("fuse.sshfs", "nfs", "nfs4") and mounted[1].endswith(f"{nodes[0].address}:/shared"), mounted
    assert {"nosuid", "nodev"} <= set(mounted[2].split(",")), mounted  # no set-user-id program or device file works there
    cluster.refresh_from_db()
    assert cluster.shared_files["method"] in ("sshfs", "nfs"), cluster.shared_files
