"""Checks of a running lab cluster's Ray for issue 27 (raylock): which of Ray's ports listen where on
every node, Ray refusing a client without the cluster's token, the token file and the runtime container's
privileges. Used by tests/integration/test_cluster_life_lab.py on its `life` cluster."""
from __future__ import annotations

import shlex
import sys

# Ray's ports that can be bound to the node's address (or the loopback) and are: never on a wildcard.
BOUND = {6383: "the dashboard agent's HTTP (job submissions)", 6385: "the runtime-env agent",
         10001: "Ray Client (head)", 8265: "the dashboard and job API (head, loopback)"}
# Ray's gRPC servers, which this Ray binds on every address whatever its flags (docs/security.md).
WILDCARD = {6379: "GCS", 6380: "raylet", 6381: "object manager", 6382: "dashboard agent gRPC",
            6386: "dashboard metrics (head)", 6387: "autoscaler metrics (head)"}
ABSENT = {6384: "the metrics exporter (turned off)"}
ANY = ("0.0.0.0", "*", "[::]", "[::ffff:0.0.0.0]")
# Run on a member, without the token: the GCS, Ray Client and a dashboard agent's job API must refuse. On
# a cluster with Ray's TLS the probe holds the member's certificate (RAY_USE_TLS and the files, as Ray's
# own processes do), so that what refuses it is the token, not the handshake.
PROBE = r'''
import json, os, sys, urllib.request, grpc
head = sys.argv[1]
seen = {}

def channel(target):
    if os.environ.get("RAY_USE_TLS") != "1":
        return grpc.insecure_channel(target)
    read = lambda name: open(os.environ[name], "rb").read()
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(
        root_certificates=read("RAY_TLS_CA_CERT"), private_key=read("RAY_TLS_SERVER_KEY"),
        certificate_chain=read("RAY_TLS_SERVER_CERT")))

from ray._raylet import GcsClient
try:
    GcsClient(address=head + ":6379").get_all_node_info(timeout=5)
    seen["gcs"] = "answered"
except Exception as exc:
    seen["gcs"] = type(exc).__name__ + ": " + str(exc)[:80]
from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc
try:
    ray_client_pb2_grpc.RayletDriverStub(channel(head + ":10001")).ClusterInfo(
        ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING), timeout=5)
    seen["client"] = "answered"
except grpc.RpcError as exc:
    seen["client"] = str(exc.code())
request = urllib.request.Request("http://%s:6383/api/job_agent/jobs/" % head, data=b'{"entrypoint": "id"}',
                                 headers={"Content-Type": "application/json"})
try:
    seen["job"] = "accepted %s" % urllib.request.urlopen(request, timeout=5).status
except Exception as exc:
    seen["job"] = str(exc)[:80]
print(json.dumps(seen))
'''


def listeners(text: str) -> dict[int, set[str]]:
    """``ss -ltnH`` -> {port: {host, ...}}."""
    found: dict[int, set[str]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and ":" in fields[3]:
            host, port = fields[3].rsplit(":", 1)
            if port.isdigit():
                found.setdefault(int(port), set()).add(host)
    return found


def check_ray_closed(lab, cluster, token: str) -> dict:
    """Every check; returns what was seen (the figures for the report)."""
    figures: dict = {}
    head = next(m for m in cluster.members.select_related("machine") if m.role == "head")
    for member in cluster.members.select_related("machine"):
        machine = member.machine
        ports = listeners(lab.ssh(machine.address, "ss -ltnH").stdout)
        figures[machine.name] = {port: sorted(ports.get(port, ())) for port in (*BOUND, *WILDCARD, *ABSENT)}
        for port, what in BOUND.items():
            assert not ports.get(port, set()) & set(ANY), f"{machine.name}: {what} listens on {ports[port]}"
        for port, what in ABSENT.items():
            assert port not in ports, f"{machine.name}: {what} listens on {ports[port]}"
        assert ports.get(6383, set()) - {"127.0.0.1"} == {member.address}, f"{machine.name}: {ports.get(6383)}"
        mode = lab.ssh(machine.address, f"stat -c '%a %U' /etc/fadenstack/clusters/{cluster.name} "
                                        f"/etc/fadenstack/clusters/{cluster.name}/ray-token").stdout.split("\n")
        assert mode[:2] == ["700 root", "600 root"], f"{machine.name}: {mode}"
        status = lab.ssh(machine.address, f"podman exec fadenstack-{cluster.name} grep -E '^(CapEff|NoNewPrivs)' /proc/1/status").stdout
        caps = dict(line.split(":\t") for line in status.strip().splitlines())
        assert caps == {"CapEff": "0000000000000000", "NoNewPrivs": "1"}, f"{machine.name}: {caps}"  # none
        figures[machine.name]["container"] = caps
    assert head.address in figures[head.machine.name][10001] or f"[::ffff:{head.address}]" in figures[head.machine.name][10001]
    assert set(figures[head.machine.name][8265]) <= {"127.0.0.1"}
    # The token is in no process's command line or environment shown by ps (the lab's machines share one table).
    assert token not in lab.ssh(head.machine.address, "ps -eo args e").stdout
    worker = next(m for m in cluster.members.select_related("machine") if m.role != "head")
    tls = f"/etc/fadenstack/clusters/{cluster.name}/tls"
    with_tls = (f"RAY_USE_TLS=1 RAY_TLS_SERVER_CERT={tls}/node.pem RAY_TLS_SERVER_KEY={tls}/node.key "
                f"RAY_TLS_CA_CERT={tls}/ca.pem " if cluster.ray_tls else "")
    probe = lab.ssh(worker.machine.address, f"env -u RAY_AUTH_MODE -u RAY_AUTH_TOKEN_PATH HOME=/nonexistent {with_tls}"
                                            f"{sys.executable} -c {shlex.quote(PROBE)} {head.address}", timeout=60)
    refused = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else probe.stderr[-500:]
    figures["without_token"] = refused
    assert "InvalidAuthToken" in refused or "AuthenticationError" in refused, refused
    assert '"client": "StatusCode.UNAUTHENTICATED"' in refused and "401" in refused, refused
    return figures
