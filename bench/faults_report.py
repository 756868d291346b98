"""The Markdown report of `bench/faults.py` (docs/resilience.md): the table, how to read it, the timelines."""
import os
import platform
import statistics
from datetime import datetime, timezone as tz
from importlib import metadata
from pathlib import Path

# What the report states, in this order: the product's settings and the beat's fixed ticks.
SHOWN = ("FADEN_HEALTH_INTERVAL", "FADEN_HEALTH_LOOK_AGAIN", "FADEN_RESTART_ATTEMPTS", "FADEN_RESTART_PAUSE",
         "FADEN_FAILED_RETRY", "FADEN_RETRY_TICK", "FADEN_HEARTBEAT_INTERVAL", "FADEN_OFFLINE_AFTER",
         "FADEN_JOB_BEAT", "FADEN_JOB_STALE", "FADEN_SSH_CONNECT_TIMEOUT")


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def host_line() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    mem = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))) / 2**20
    return f"{os.cpu_count()} CPUs (`nproc`) {cpu}, {mem:.0f} GiB memory, Linux {platform.release()}"


def report(bench, rows: list, *, command: str, wall: float, stated: list[str]) -> str:
    v = bench.value
    pause = v["FADEN_RESTART_PAUSE"]
    pauses = ", ".join(f"{pause * 2 ** i} s" for i in range(v["FADEN_RESTART_ATTEMPTS"] - 1))
    lines = [
        "# Resilience: failures on a running cluster",
        "",
        "Written by `bench/faults.py`; every run rewrites this file. What it does: a whole console in processes of",
        "its own (Daphne, one Celery worker, beat) on a throwaway SQLite database, the lab's lab-a, lab-b and lab-c",
        "enrolled through the worker and started as one cluster (lab-a the head, on the fabric network",
        "198.18.1.0/24); then one failure at a time, each undone and the cluster back to Running with every machine",
        "Up before the next. From each fault on the bench reads the console's database every 0.2 s, which is what",
        "the pages show.",
        "",
        f"- Run: {datetime.now(tz.utc):%Y-%m-%d %H:%M} UTC, `{command}`, {wall / 60:.1f} minutes in all.",
        f"- Host: {host_line()}; Ray {metadata.version('ray')}. The three machines share these cores.",
        "- Intervals: " + ", ".join(f"{name}={v[name]}" for name in SHOWN) + "; machines are marked offline by a beat tick "
        "every 10 s.",
        "- " + ("; ".join(stated) if stated else "Every interval is the product's default: what an administrator sees."),
        "",
        "**First sign**: seconds from the fault until the cluster's page first showed it (a machine no longer Up, the",
        "cluster no longer Running, or words under its state), and what it said. **Ready again**: seconds until",
        "Running with every machine Up and no words, from the fault, and for a fault that was undone (link up, power",
        "on) also from that.",
        "",
    ]
    repeated = sorted({row.case for row in rows if sum(1 for r in rows if r.case == row.case) > 1}, key=list(bench.CASES).index)
    if repeated:
        lines += ["| failure | runs | ready again: median (s) | worst (s) |", "| --- | --- | --- | --- |"]
        for name in repeated:
            ready = sorted(r.ready for r in rows if r.case == name and r.ready is not None)
            runs = sum(1 for r in rows if r.case == name)
            median = seconds(statistics.median(ready)) if ready else "—"
            worst = seconds(ready[-1]) if len(ready) == runs else f"{runs - len(ready)} never ready"
            lines.append(f"| {cell(bench.CASES[name][0].format(link=bench.args.link_down))} | {runs} | {median} | {worst} |")
        lines.append("")
    lines += [
        "| failure | first sign (s, and what) | ready again (s) | what the console said and did |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        sign = f"{row.first_sign[0]:.1f}: {row.first_sign[1]}" if row.first_sign else "none"
        aside = []
        if row.offline_at and (not row.first_sign or row.offline_at[0] < row.first_sign[0]):
            aside.append(f"the machines page read {row.offline_at[1]} Offline at {row.offline_at[0]:.1f}")
        if row.phase is not None:
            aside.append(f"the fault came {row.phase:.0f} s after a scheduled check began")
        if aside:
            sign += f" ({'; '.join(aside)})"
        ready = seconds(row.ready)
        if row.repaired_at is not None and row.ready is not None:
            undo = "link-up" if "link" in row.failure else "power-on"
            ready += f" ({row.ready - row.repaired_at:.1f} after {undo} at {row.repaired_at:.1f})"
        if row.failed_at is not None:
            ready = f"Failed after {row.failed_at:.1f}; ready {ready}"
        did = " → ".join(row.did) or "nothing"
        failure = row.failure
        if row.note:
            did += f" *{row.note}*"
        lines.append(f"| {cell(failure)} | {cell(sign)} | {cell(ready)} | {cell(did)} |")
    lines += [
        "",
        "## How to read it",
        "",
        f"- A failure a machine's heartbeat reports (Ray killed, the runtime's container stopped) is checked at its next "
        f"beat, every {v['FADEN_HEARTBEAT_INTERVAL']} s: from 0 to {v['FADEN_HEARTBEAT_INTERVAL']} s after the fault, plus "
        f"the check's own seconds. A failure only looking finds (a link down) shows at the next scheduled check, every "
        f"{v['FADEN_HEALTH_INTERVAL']} s: from 0 to {v['FADEN_HEALTH_INTERVAL']} s after the fault, "
        f"{v['FADEN_HEALTH_INTERVAL'] / 2:.0f} s on average. The first-sign column says how long after a scheduled check "
        f"the fault came: such a sign is due about {v['FADEN_HEALTH_INTERVAL']} s minus that, plus the check's own seconds.",
        "- A worker cut off on the cluster's network is seen through Ray's node list only: Ray marks a node dead after its "
        "own health checks have failed for a while (the \"until the console shows it\" row measures how long), so a "
        "shorter loss of the link shows nothing, and until then the checks read all well.",
        f"- Nothing is repaired on the first look: a second look follows (\"Looking again\"), on purpose: a slow answer is "
        f"not a dead head. For a failure a heartbeat reported it comes with that machine's next beat "
        f"({v['FADEN_HEARTBEAT_INTERVAL']} s later), for any other {v['FADEN_HEALTH_LOOK_AGAIN']} s later. Only then does a "
        "worker join again or the whole cluster restart, so a repair starts at least that long after the first sign.",
        f"- A worker out of Ray joins again while the other machines keep serving; a head that stopped restarts the "
        f"whole cluster, up to {v['FADEN_RESTART_ATTEMPTS']} times with pauses of {pauses} between restarts (and the "
        f"retry tick of {v['FADEN_RETRY_TICK']} s), then Failed, tried again every {v['FADEN_FAILED_RETRY'] // 60 or 1} minutes.",
        f"- A machine without a heartbeat for {v['FADEN_OFFLINE_AFTER']} s (it beats every {v['FADEN_HEARTBEAT_INTERVAL']} s) "
        "reads Offline. No worker is repaired while a machine is offline; the heartbeat after power-on marks it "
        "reconnected, which checks the cluster at once, and a Failed cluster whose head reconnected starts over "
        "without waiting for its retry.",
        "",
        "## Timelines",
        "",
        "Seconds from the fault; every change the bench saw (checks and jobs when they finished).",
    ]
    for row in rows:
        lines += ["", f"### {row.failure}", ""]
        lines += [f"- {t:.1f} s: {words}" for t, words in row.timeline] or ["- nothing changed"]
        if row.note:
            lines.append(f"- {row.note}")
    return "\n".join(lines) + "\n"
