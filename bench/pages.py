#!/usr/bin/env python
"""Every page, API call and live render of the console at 10, 100 and 1,000 machines: server time and queries.

    .venv/bin/python bench/pages.py                                   # SQLite in a temporary directory
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/faden_bench_perf .venv/bin/python bench/pages.py
    .venv/bin/python bench/pages.py --sizes 1000 --runs 7 --only wizard
    .venv/bin/python bench/pages.py --sizes 1000 --profile "join-candidates"
    .venv/bin/python bench/pages.py --runs 20 --stat min                   # the table in docs/performance.md

For each size it empties the database, seeds N machines straight into it (the
facts an H100, A100, MI300X or GH200 host reports, interfaces on three
networks, in 60 clusters at 1,000 machines with their status as a health
check writes it, runtime images of 2 GiB in 8 MiB chunks, two months of
events, a week of health checks, the jobs), then requests every page and API
call with Django's test client in this process and renders every live topic.
It prints, for each, the median server time of --runs requests (or the
fastest, --stat min, steadier on a busy host), the number of queries and the
size of the answer. On PostgreSQL the tables are vacuumed and analysed after
seeding, as autovacuum would have left them.

The database is emptied: give it one of its own (its name must contain
"bench"). Redis (REDIS_URL, default db 5) is only reached by the push timing
(--pushes), under a channel prefix of its own.
"""
import argparse
import cProfile
import hashlib
import os
import pstats
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RACK = 50  # machines per rack: they share a fabric subnet, and clusters are made within a rack
GIB = 1 << 30
CHUNK = 8 << 20


def setup_django() -> None:
    data_dir = tempfile.mkdtemp(prefix="fadenstack-bench-pages-")
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{data_dir}/bench.sqlite3")
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/5")
    os.environ.setdefault("FADEN_DB_CONN_MAX_AGE", "600")  # time the pages, not the connection's setup
    os.environ.update(FADEN_DATA_DIR=data_dir, DJANGO_SETTINGS_MODULE="config.settings", FADEN_LOG_LEVEL="WARNING")
    import django

    django.setup()
    from django.conf import settings

    name = str(settings.DATABASES["default"]["NAME"])
    if "bench" not in name:
        sys.exit(f"bench/pages.py empties its database; {name} does not look like a bench database (no 'bench' in its name)")
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


# -- seeding ------------------------------------------------------------------------------------------------

# (vendor, model, count, memory_mib, arch) by rack: most racks H100, then A100, MI300X and GH200.
KINDS = [
    ("nvidia", "NVIDIA H100 80GB HBM3", 8, 81559, "x86_64"),
    ("nvidia", "NVIDIA H100 80GB HBM3", 8, 81559, "x86_64"),
    ("nvidia", "NVIDIA A100-SXM4-40GB", 4, 40960, "x86_64"),
    ("amd", "AMD Instinct MI300X OAM", 8, 196592, "x86_64"),
    ("nvidia", "NVIDIA GH200 480GB", 1, 97871, "aarch64"),
]


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def mac(i: int, port: int) -> str:
    return f"3c:ec:ef:{i >> 8 & 255:02x}:{i & 255:02x}:{port:02x}"


def fabric_ip(i: int) -> str:
    rack, slot = divmod(i, RACK)
    return f"10.{100 + rack}.0.{slot + 1}"


def interfaces_of(i: int) -> list[dict]:
    """What the agent reports for machine ``i``: management on 10.0.0.0/16 (every machine), the rack's
    fabric /24, storage on every other rack, Docker's bridge everywhere, a VPN on every fourth machine."""
    rack, slot = divmod(i, RACK)
    mgmt = f"10.0.{i // 250}.{i % 250 + 1}"
    found = [
        {"name": "lo", "kind": "loopback", "mac": "00:00:00:00:00:00", "mtu": 65536, "state": "up",
         "addresses": ["127.0.0.1/8", "::1/128"], "speed_mbps": None, "default_route": False, "master": None},
        {"name": "eno1", "kind": "physical", "mac": mac(i, 0), "mtu": 1500, "state": "up",
         "addresses": [f"{mgmt}/16", f"2001:db8:10::{i + 1:x}/64"], "speed_mbps": 25000, "default_route": True, "master": None},
        {"name": "eno2", "kind": "physical", "mac": mac(i, 1), "mtu": 1500, "state": "down", "addresses": [],
         "speed_mbps": None, "default_route": False, "master": None},
        {"name": "ibp26s0", "kind": "physical", "mac": mac(i, 2), "mtu": 4092, "state": "up",
         "addresses": [f"{fabric_ip(i)}/24"], "speed_mbps": 400000, "default_route": False, "master": None},
        {"name": "docker0", "kind": "virtual", "mac": mac(i, 3), "mtu": 1500, "state": "down",
         "addresses": ["172.17.0.1/16"], "speed_mbps": None, "default_route": False, "master": None},
    ]
    if rack % 2 == 0:
        found.append({"name": "bond0", "kind": "physical", "mac": mac(i, 4), "mtu": 9000, "state": "up",
                      "addresses": [f"10.50.{rack}.{slot + 1}/24"], "speed_mbps": 200000, "default_route": False, "master": None})
    if i % 4 == 0:
        found.append({"name": "wg0", "kind": "vpn", "mac": "", "mtu": 1420, "state": "up",
                      "addresses": [f"10.250.{i // 250}.{i % 250 + 1}/16", f"fd10:250::{i + 1:x}/64"],
                      "speed_mbps": None, "default_route": False, "master": None})
    return found


def facts_of(i: int, name: str) -> dict:
    vendor, model, count, memory, arch = KINDS[i // RACK % len(KINDS)]
    return {
        "agent_version": "0.1.0", "hostname": f"{name}.dc1.example.com", "arch": arch, "cpu_count": 192,
        "memory_mib": 2063937, "kernel": "6.8.0-45-generic", "os": "Ubuntu 24.04.1 LTS",
        "store": {"path": "/var/lib/fadenstack", "free_bytes": 3_200_000_000_000, "total_bytes": 3_840_000_000_000},
        "accelerators": [
            {"index": n, "vendor": vendor, "model": model, "memory_mib": memory,
             "uuid": f"GPU-{sha(f'{name}-{n}')[:8]}-{sha(name)[:4]}-4d37-b2a7-{sha(f'{n}{name}')[:12]}",
             "pci_bus_id": f"0000:{0x18 + 0x10 * n:02x}:00.0"}
            for n in range(count)
        ],
        "interfaces": interfaces_of(i),
        "container_runtime": {"name": "docker", "version": "27.3.1"},
        "warnings": [],
    }


@contextmanager
def given_times(*fields):
    """Let bulk_create keep the times the seed gives (auto_now_add would stamp them all now)."""
    for field in fields:
        field.auto_now_add = False
    try:
        yield
    finally:
        for field in fields:
            field.auto_now_add = True


def settle() -> None:
    """Leave the tables as a console's would be: PostgreSQL's autovacuum reclaims the rows an earlier
    seed deleted and gathers the planner's statistics, but only after a while. Without this the
    pages would be timed against tables many times their size and plans made for empty ones."""
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("VACUUM (ANALYZE)")


def seed(n: int) -> dict:
    """N machines, their clusters and their history; returns the ids the requests use."""
    from django.contrib.auth import get_user_model
    from django.db import transaction
    from django.utils import timezone

    from clusters.choices import CheckOutcome, CheckTrigger, ClusterState, MemberState, Role
    from clusters.models import Cluster, ClusterMember, HealthCheck, NetworkMeasurement, RuntimeImage, Transfer
    from console.choices import JobState, StepState
    from console.models import Job
    from machines.choices import EventKind, MachineState
    from machines.models import Accelerator, Machine, MachineEvent, NetworkInterface
    from machines.services import _interface_row

    now = timezone.now()
    for model in (HealthCheck, NetworkMeasurement, ClusterMember, Cluster, RuntimeImage, Job, MachineEvent, Machine):
        model.objects.all().delete()
    user, _ = get_user_model().objects.get_or_create(username="bench", defaults={"is_staff": True, "is_superuser": True})

    with transaction.atomic(), given_times(Job._meta.get_field("created_at"), MachineEvent._meta.get_field("created_at"),
                                           HealthCheck._meta.get_field("started_at")):
        images = {}
        for vendor, arch, version in [("nvidia", "x86_64", "2.0.0"), ("nvidia", "x86_64", "2.1.0"), ("amd", "x86_64", "2.1.0"),
                                      ("nvidia", "aarch64", "2.1.0")]:
            digest = sha(f"{vendor}-{arch}-{version}")
            images[(vendor, arch, version)] = RuntimeImage.objects.create(
                name=f"{vendor.upper()} {arch} Runtime", version=version, digest=digest, size_bytes=2 * GIB, chunk_size=CHUNK,
                chunk_hashes=[sha(f"{digest}-{c}") for c in range(2 * GIB // CHUNK)], arch=arch, accelerator_vendor=vendor,
                path=f"/var/lib/fadenstack/runtime-images/{digest}.img")

        machines = []
        for i in range(n):
            slot = i % RACK
            name = f"gpu-{i:04d}"
            state = {49: MachineState.HOST_KEY, 48: MachineState.OFFLINE, 47: MachineState.FAILED, 46: MachineState.ENROLLING}.get(
                slot, MachineState.OFFLINE if i % 97 == 5 else MachineState.HEALTHY)
            facts = {} if state == MachineState.HOST_KEY else facts_of(i, name)
            machines.append(Machine(
                name=name, address=f"10.0.{i // 250}.{i % 250 + 1}", host_key_fingerprint="SHA256:" + sha(name)[:43],
                state=state, state_reason="No heartbeat for 31 s." if state == MachineState.OFFLINE else "",
                arch=facts.get("arch", ""), hostname=facts.get("hostname", ""), cpu_count=facts.get("cpu_count"),
                memory_mib=facts.get("memory_mib"), store_path="/var/lib/fadenstack", store_free_bytes=3_200_000_000_000,
                store_total_bytes=3_840_000_000_000, container_runtime="docker", agent_version="0.1.0",
                agent_path="/var/lib/fadenstack/agent/fadenstack-agent.pyz", python_path="/usr/bin/python3", facts=facts,
                facts_at=now if facts else None, heartbeat_token_hash=sha(f"token-{name}"),
                last_seen=now - timedelta(seconds=40 if state == MachineState.OFFLINE else 3)))
        machines = Machine.objects.bulk_create(machines)
        Accelerator.objects.bulk_create(
            Accelerator(machine=m, index=a["index"], vendor=a["vendor"], model=a["model"], memory_mib=a["memory_mib"],
                        uuid=a["uuid"], pci_bus_id=a["pci_bus_id"])
            for m in machines for a in m.facts.get("accelerators", []))
        NetworkInterface.objects.bulk_create(_interface_row(m, iface) for m in machines for iface in m.facts.get("interfaces", []))

        # Clusters: three of 13 machines in each full rack (one of 70 % of a small one); the rest stay free.
        groups = []
        for start in range(0, n, RACK):
            rack = machines[start:start + RACK]
            usable = [m for m in rack if m.facts]
            count, size = (3, 13) if len(rack) >= 40 else (1, max(2, int(len(rack) * 0.7)))
            groups += [usable[k * size:(k + 1) * size] for k in range(count)]
        members, sources, measurements = [], [], []
        for c, group in enumerate(groups):
            head = group[0]
            head_index = int(head.name.removeprefix("gpu-"))
            vendor, _, _, _, arch = KINDS[head_index // RACK % len(KINDS)]
            image = images[(vendor, arch, "2.0.0" if c % 9 == 4 and vendor == "nvidia" and arch == "x86_64" else "2.1.0")]
            state = (ClusterState.STOPPED if c % 10 == 7 else ClusterState.RETRYING if c % 10 == 8
                     else ClusterState.FAILED if c % 15 == 14 else ClusterState.RUNNING)
            fabric = f"10.{100 + head_index // RACK}.0.0/24"
            nodes, agents = [], {}
            for m in group:
                ip = fabric_ip(int(m.name.removeprefix("gpu-")))
                gpus = len(m.facts["accelerators"])
                runtime = {"running": True, "digest": "sha256:" + image.digest, "version": image.version,
                           "container": f"fadenstack-runtime-{image.digest[:12]}", "started_at": (now - timedelta(days=3)).isoformat(),
                           "ray": {"running": True, "pid": 4242, "version": "2.40.0", "gcs_address": f"{fabric_ip(head_index)}:6379",
                                   "node_ip": ip, "log": "/var/lib/fadenstack/ray/session_latest/logs"}}
                node = {"node_id": sha(m.name)[:56], "address": ip, "alive": True, "gpus": gpus, "hostname": m.hostname,
                        "resources": {"CPU": 192.0, "GPU": float(gpus), "memory": 1.7e12, "object_store_memory": 2e11, f"node:{ip}": 1.0}}
                nodes.append(node)
                agents[m.name] = {"machine": m.name, "machine_state": m.state, "runtime": runtime}
                members.append(ClusterMember(
                    machine=m, role=Role.HEAD if m is head else Role.WORKER, address=ip,
                    state={ClusterState.RUNNING: MemberState.JOINED, ClusterState.STOPPED: MemberState.STOPPED}.get(state, MemberState.FAILED),
                    runtime_image=image, ray_node_id=node["node_id"], accelerators_in_ray=gpus,
                    last_status={"runtime": runtime, "ray_node": node, "error": ""}))
                sources.append("the server" if m is head else f"{head.name} ({fabric_ip(head_index)})")
                if m is not head:
                    measurements.append(NetworkMeasurement(subnet=fabric, source=head, target=m, mbps=380_000 - 100 * len(measurements)))
            cluster = Cluster.objects.create(
                name=f"cluster-{c:02d}", state=state, network=fabric, runtime_version="2",
                last_status={"checked_at": now.isoformat(), "head_ray": {"nodes": nodes}, "agents": agents}, last_status_at=now)
            for member in members[-len(group):]:
                member.cluster = cluster
        ClusterMember.objects.bulk_create(members)
        # Each member holds its runtime image whole, sent by the server to the head and by the head to the others.
        Transfer.objects.bulk_create(
            Transfer(member=member, digest=member.runtime_image.digest, what="the runtime image", source=source,
                     bytes_done=member.runtime_image.size_bytes, bytes_total=member.runtime_image.size_bytes, rate=1.1e9,
                     bytes_fetched=member.runtime_image.size_bytes)
            for member, source in zip(members, sources))
        NetworkMeasurement.objects.bulk_create(measurements)
        clusters = list(Cluster.objects.order_by("name"))

        events = []
        for m in machines:
            for e in range(30):  # two months of a machine's life
                kind = [EventKind.STATE, EventKind.FACTS, EventKind.RECONNECTED][e % 3]
                message = {EventKind.STATE: "Offline: No heartbeat for 31 s.", EventKind.FACTS: "Facts read: 8 accelerators, 6 interfaces.",
                           EventKind.RECONNECTED: "Healthy: heartbeats again after 2 min 10 s."}[kind]
                events.append(MachineEvent(machine=m, kind=kind, message=message, created_at=now - timedelta(hours=48 * e + m.pk % 48)))
        MachineEvent.objects.bulk_create(events, batch_size=5000)

        def steps(names, state=StepState.DONE):
            return [{"name": s, "state": state, "detail": "", "started_at": now.isoformat()} for s in names]

        jobs = []
        for m in machines:
            for k, title in enumerate(("Enrol", "Refresh facts of")):
                when = now - timedelta(days=60 - 30 * k, minutes=m.pk % 600)
                jobs.append(Job(kind="machine.enrol", title=f"{title} {m.name}", target_type="machine", target_id=m.pk,
                                state=JobState.SUCCEEDED, steps=steps(["Connect", "Check Python", "Install the agent", "Read facts", "Start the heartbeat"]),
                                log="connected\nagent 0.1.0 installed\nfacts read\n", worker="celery@worker-1", created_by=user,
                                created_at=when, started_at=when, finished_at=when + timedelta(seconds=14)))
        for c, cluster in enumerate(clusters):
            for k in range(8):
                when = now - timedelta(days=20 - 2 * k, minutes=c)
                jobs.append(Job(kind="cluster.start", title=f"Start {cluster.name}", target_type="cluster", target_id=cluster.pk,
                                state=JobState.FAILED if cluster.state == ClusterState.FAILED and k == 7 else JobState.SUCCEEDED,
                                steps=steps(["Get the runtime image", "Load the image", "Start Ray on the head", "Join the other machines", "Check with Ray"]),
                                created_at=when, started_at=when, finished_at=when + timedelta(minutes=4), worker="celery@worker-1"))
        Job.objects.bulk_create(jobs, batch_size=2000)

        checks = []
        for cluster in clusters:
            if cluster.state != ClusterState.RUNNING:
                continue
            names = sorted(cluster.last_status["agents"])
            for k in range(200):  # a week, at the pace of FADEN_HEALTH_INTERVAL bursts and reconnects
                when = now - timedelta(minutes=50 * k + 1)
                checks.append(HealthCheck(cluster=cluster, trigger=CheckTrigger.SCHEDULE, outcome=CheckOutcome.HEALTHY,
                                          looked_at=["Ray on the head", *[f"the agent on {name}" for name in names]], found=[],
                                          action="", started_at=when, finished_at=when + timedelta(seconds=2)))
        HealthCheck.objects.bulk_create(checks, batch_size=2000)
    settle()

    running = next(c for c in clusters if c.state == ClusterState.RUNNING)
    member_ids = list(running.members.order_by("machine__name").values_list("machine_id", flat=True))
    in_clusters = {member.machine_id for member in members}
    free = [m.pk for m in machines if m.state == MachineState.HEALTHY and m.pk not in in_clusters]
    # Ticked in the wizard: four free machines of one rack (they share its fabric), the first of them the head.
    same_rack = [pk for pk in free if (pk - machines[0].pk) // RACK == (free[0] - machines[0].pk) // RACK][:4]
    return {"user": user, "cluster": running.pk, "machine": member_ids[1], "picked": same_rack or free[:4],
            "counts": {"machines": n, "clusters": len(clusters), "members": len(members), "events": len(events),
                       "jobs": len(jobs), "checks": len(checks)}}


# -- what is measured -----------------------------------------------------------------------------------------


def requests_for(ids: dict) -> list[tuple[str, dict]]:
    """(name, how) for every page, API call and live render; how is a URL (and headers) or a topic."""
    c, m = ids["cluster"], ids["machine"]
    picked = ",".join(map(str, ids["picked"]))
    wizard = f"/clusters/new/?name=bench-new&machines={picked}"
    api = {"HTTP_ACCEPT": "application/json"}
    htmx = {"HTTP_HX_REQUEST": "true"}
    return [
        ("dashboard", {"url": "/"}),
        ("machines list", {"url": "/machines/"}),
        ("machine page", {"url": f"/machines/{m}/"}),
        ("clusters list", {"url": "/clusters/"}),
        ("cluster page", {"url": f"/clusters/{c}/"}),
        ("wizard: name step", {"url": "/clusters/new/"}),
        ("wizard: machine step", {"url": f"{wizard}&step=machines"}),
        ("wizard: machine step, a box ticked (htmx)", {"url": f"{wizard}&step=machines", "headers": htmx}),
        ("wizard: machine step, found by name, page 2", {"url": f"{wizard}&step=machines&q=gpu-0&page=2"}),
        ("wizard: machine step, by kind and state", {"url": f"{wizard}&step=machines&kind=nvidia/x86_64&state=available"}),
        ("wizard: network step", {"url": f"{wizard}&step=network&head={ids['picked'][0]}"}),
        ("add machines", {"url": f"/clusters/{c}/add/"}),
        ("add machines, by kind and state, page 2", {"url": f"/clusters/{c}/add/?kind=nvidia/x86_64&state=available&page=2"}),
        ("change the network", {"url": f"/clusters/{c}/network/"}),
        ("GET /api/machines/", {"url": "/api/machines/", "headers": api}),
        ("GET /api/machines/<id>/", {"url": f"/api/machines/{m}/", "headers": api}),
        ("GET /api/clusters/", {"url": "/api/clusters/", "headers": api}),
        ("GET /api/clusters/<id>/", {"url": f"/api/clusters/{c}/", "headers": api}),
        ("GET /api/clusters/<id>/join-candidates/", {"url": f"/api/clusters/{c}/join-candidates/", "headers": api}),
        ("GET /api/clusters/<id>/join-candidates/?state=&page=2",
         {"url": f"/api/clusters/{c}/join-candidates/?state=available&page=2", "headers": api}),
        ("GET /api/clusters/<id>/health-checks/", {"url": f"/api/clusters/{c}/health-checks/", "headers": api}),
        ("GET /api/clusters/networks/?machines=", {"url": f"/api/clusters/networks/?machines={picked}", "headers": api}),
        ("live: machines", {"topic": "machines"}),
        ("live: machines, one row", {"topic": "machines", "part": str(m)}),
        ("live: machine:<id>", {"topic": f"machine:{m}"}),
        ("live: clusters", {"topic": "clusters"}),
        ("live: cluster:<id>", {"topic": f"cluster:{c}"}),
        ("live: cluster:<id> members", {"topic": f"cluster:{c}", "part": "members"}),
        ("live: cluster:<id> job", {"topic": f"cluster:{c}", "part": "job"}),
        ("live: cluster:<id> checks", {"topic": f"cluster:{c}", "part": "checks"}),
    ]


def run_once(client, how: dict) -> int:
    """One request or render; the size of what it answered, in bytes."""
    from console import live, roles

    if "topic" in how:
        return sum(len(html.encode()) for html in live.render_topic(how["topic"], how.get("part", ""), roles.ADMINISTRATOR))
    response = client.get(how["url"], **how.get("headers", {}))
    if response.status_code != 200:
        sys.exit(f"{how['url']} answered {response.status_code}: {response.content[:500]!r}")
    return len(response.content)


def measure(client, how: dict, runs: int, stat=statistics.median) -> tuple[float, int, int]:
    """Milliseconds of ``runs`` runs (their median, or another ``stat``), queries and bytes of one
    (a first run warms the caches)."""
    from django.db import connection

    queries = []

    def count(execute, sql, params, many, context):
        queries.append(sql)
        return execute(sql, params, many, context)

    # A wrapper, not CaptureQueriesContext: a request's start empties connection.queries.
    with connection.execute_wrapper(count):
        size = run_once(client, how)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run_once(client, how)
        times.append((time.perf_counter() - started) * 1000)
    return stat(times), len(queries), size


def profile(client, name: str, how: dict) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    run_once(client, how)
    profiler.disable()
    print(f"\n--- profile of {name} ---")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


# -- pushes -------------------------------------------------------------------------------------------------


def time_pushes(count: int, machine_id: int) -> list[tuple[str, float]]:
    """Milliseconds per push: the transport alone (a tiny card), and a machine's card, watched and not."""
    import asyncio
    import uuid

    from asgiref.sync import async_to_sync
    from channels.layers import channel_layers, get_channel_layer
    from django.conf import settings

    from console import live, roles

    settings.CHANNEL_LAYERS = {"default": {**settings.CHANNEL_LAYERS["default"],
                                           "CONFIG": {**settings.CHANNEL_LAYERS["default"]["CONFIG"], "prefix": f"bench-{uuid.uuid4().hex[:8]}"}}}
    channel_layers.backends.clear()
    live.register("bench", lambda arg, part, role: ['<div id="bench" hx-swap-oob="true">1</div>'])
    results = []

    def timed(label: str, topic: str) -> None:
        started = time.perf_counter()
        for _ in range(count):
            live.push(topic)  # outside a transaction: sent at once
        results.append((label, (time.perf_counter() - started) * 1000 / count))

    timed("push, nobody watches, tiny card", "bench")
    timed("push, nobody watches, machine:<id>", f"machine:{machine_id}")

    # A watcher: a consumer's channel in both groups, in an event loop of its own thread.
    import threading

    ready, done = threading.Event(), threading.Event()
    received = []

    def watcher():
        async def watch():
            layer = get_channel_layer()
            channel = await layer.new_channel()
            await layer.group_add(live.group_name("bench", roles.ADMINISTRATOR), channel)
            await layer.group_add(live.group_name(f"machine:{machine_id}", roles.ADMINISTRATOR), channel)
            ready.set()
            while not done.is_set():
                try:
                    received.append(await asyncio.wait_for(layer.receive(channel), 0.2))
                except asyncio.TimeoutError:
                    pass
            await layer.flush()

        asyncio.run(watch())

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    ready.wait(10)
    timed("push, watched, tiny card", "bench")
    timed("push, watched, machine:<id>", f"machine:{machine_id}")
    time.sleep(1)
    done.set()
    thread.join(10)
    results.append((f"(the watcher received {len(received)} of {2 * count})", 0.0))
    async_to_sync(get_channel_layer().flush)()
    return results


# -- main -----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,1000", help="machine counts, comma separated")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each request")
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="which of the runs to show: min is steadier on a busy host (other processes take the CPU)")
    parser.add_argument("--only", default="", help="only the requests whose name contains this")
    parser.add_argument("--profile", default="", help="profile the requests whose name contains this, at the largest size")
    parser.add_argument("--pushes", type=int, default=0, help="also time this many live pushes (needs Redis)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    setup_django()
    from django.conf import settings
    from django.test import Client

    db = settings.DATABASES["default"]
    stat = {"median": statistics.median, "min": min}[args.stat]
    print(f"database: {db['ENGINE'].rsplit('.', 1)[-1]} {db['NAME']}; {args.runs} timed runs each, {args.stat} shown; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    table: dict[str, dict[int, tuple[float, int, int]]] = {}
    for n in sizes:
        started = time.perf_counter()
        ids = seed(n)
        print(f"seeded {n} machines in {time.perf_counter() - started:.1f} s: {ids['counts']}")
        client = Client()
        client.force_login(ids["user"])
        for name, how in requests_for(ids):
            if args.only and args.only not in name:
                continue
            table.setdefault(name, {})[n] = measure(client, how, args.runs, stat)
            if args.profile and args.profile in name and n == sizes[-1]:
                profile(client, name, how)
        if args.pushes and n == sizes[-1]:
            pushes = time_pushes(args.pushes, ids["machine"])

    width = max(len(name) for name in table) + 2
    print()
    print("".ljust(width) + "".join(f"{f'{n} machines':>26}" for n in sizes))
    print("request".ljust(width) + "".join(f"{'ms':>10}{'queries':>8}{'KB':>8}" for _ in sizes))
    for name, by_size in table.items():
        cells = "".join(f"{by_size[n][0]:>10.1f}{by_size[n][1]:>8}{by_size[n][2] / 1000:>8.1f}" if n in by_size else " " * 26
                        for n in sizes)
        print(name.ljust(width) + cells)
    if args.pushes:
        print(f"\n{args.pushes} live pushes at {sizes[-1]} machines, ms per push:")
        for label, ms in pushes:
            print(f"  {label:<40} {ms:8.3f}" if ms else f"  {label}")


if __name__ == "__main__":
    main()
