"""The gateway against its peers (``bench/gateway.py --peers``): vLLM's router and LiteLLM's proxy in front of
the same engine, on the same requests, in the same run as the engine directly and the gateway.

    .venv/bin/python bench/gateway.py --peers                          # the builtin engine, all four paths
    .venv/bin/python bench/gateway.py --peers --gateway-workers 1,2    # the gateway with one worker and with two
    .venv/bin/python bench/gateway.py --peers --engine lab --seconds 6 --rounds 3

Each peer is installed by the bench, the first time, into a virtual environment of its own under
``--peers-cache`` (``~/.cache/fadenstack-bench/peers/<name>-<version>``), its release pinned below, from wheels
only; it is never a dependency of the console. A peer that cannot be installed is reported with pip's reason,
and its column says so. A peer whose packages leave a ``.pth`` file that imports code at every start of Python
(as litellm 1.82.7 and 1.82.8 did, in March 2026) is refused before anything runs there.

- vLLM's router (Rust; the PyPI wheel starts it): ``--worker-urls`` the engine, ``--policy round_robin`` (its
  cheapest; its default, ``cache_aware``, keeps a prefix tree of every prompt: with one engine it would only add
  work), its Prometheus listener on loopback. It takes no key from clients.
- LiteLLM's proxy (Python, uvicorn, one worker: its default and its production advice), a ``config.yaml`` whose
  ``model_list`` names the engine as an OpenAI-compatible ``api_base``, a master key (it refuses to start
  without one; the bench sends it as the gateway's key is sent), no database (no ``DATABASE_URL``), no Redis,
  and every catalogue it would fetch from the internet at start read from its package instead
  (``LITELLM_LOCAL_*``). Its environment holds nothing of the bench's but ``PATH``, ``HOME`` and the locale.

Every path gets the same chat completion, answered whole and streamed, at 1, 16 and 64 concurrent, in
``--rounds`` short rounds whose order turns each round, so that what else runs on the machine weighs on all
alike. The CPU of each router is its processes' user and system time (``/proc/<pid>/stat``, the process and all
its descendants: uvicorn's workers too) over the run.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import gateway as base

TICKS = os.sysconf("SC_CLK_TCK")
KINDS = ("whole", "stream")
CONCURRENCY = (1, 16, 64)
DEFAULT_CACHE = Path.home() / ".cache" / "fadenstack-bench" / "peers"
# .pth files whose import lines Python runs at every start: setuptools' own is harmless (and *-nspkg.pth, below).
HARMLESS_PTH = ("distutils-precedence.pth",)


@dataclass(frozen=True)
class Peer:
    name: str  # its column
    requirement: str  # what pip installs, without the version
    version: str  # the release measured (litellm 1.106.12: the last whose [proxy] extra resolves on this index;
    # 1.108 and later require litellm-proxy-extras or litellm-proxy releases it does not hold)

    @property
    def pinned(self) -> str:
        return f"{self.requirement}=={self.version}"


PEERS = (Peer("vllm-router", "vllm-router", "0.1.17"), Peer("litellm", "litellm[proxy]", "1.106.12"))


def add_arguments(parser) -> None:
    parser.add_argument("--peers", action="store_true",
                        help="vLLM's router and LiteLLM's proxy beside the engine and the gateway, side by side")
    parser.add_argument("--peers-cache", default=str(DEFAULT_CACHE), help="where the peers' environments are kept")
    parser.add_argument("--gateway-workers", default="1",
                        help="with --peers: the gateway's worker counts to measure, one column each (e.g. 1,2)")


# -- installing ---------------------------------------------------------------------------------------------


def pip_reason(output: str) -> str:
    """What pip said went wrong: its ERROR lines, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return " ".join(errors) if errors else (lines[-1] if lines else "pip said nothing")


def startup_hooks(site_packages: Path) -> list[str]:
    """The .pth files that import code at every start of Python (the harmless usual ones aside)."""
    found = []
    for path in sorted(site_packages.glob("*.pth")):
        if path.name in HARMLESS_PTH or path.name.endswith("-nspkg.pth"):
            continue
        if any(line.lstrip().startswith("import") for line in path.read_text(errors="replace").splitlines()):
            found.append(path.name)
    return found


def peer_install(peer: Peer, cache: Path) -> tuple[Path | None, str]:
    """The peer's environment (made the first time: a venv, its pinned release from wheels only), or None and why."""
    home = cache / f"{peer.name}-{peer.version}"
    if (home / "installed.txt").exists():
        return home, ""
    shutil.rmtree(home, ignore_errors=True)  # a try that did not finish
    cache.mkdir(parents=True, exist_ok=True)
    print(f"Installing {peer.pinned} into {home} (the first time only) ...", flush=True)
    made = subprocess.run([sys.executable, "-m", "venv", str(home)], capture_output=True, text=True)
    if made.returncode != 0:
        return None, f"its virtual environment could not be made: {made.stderr.strip() or made.stdout.strip()}"
    try:
        pip = subprocess.run([str(home / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                              "--no-input", "--only-binary", ":all:", peer.pinned],
                             capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        shutil.rmtree(home, ignore_errors=True)
        return None, "pip did not finish within 30 minutes"
    if pip.returncode != 0:
        shutil.rmtree(home, ignore_errors=True)
        return None, pip_reason(pip.stdout + "\n" + pip.stderr)
    hooks = [name for site in home.glob("lib/python*/site-packages") for name in startup_hooks(site)]
    if hooks:
        shutil.rmtree(home, ignore_errors=True)
        return None, (f"its packages left files that Python runs at every start ({', '.join(hooks)}), as a "
                      "compromised release does: removed, not started")
    freeze = subprocess.run([str(home / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True)
    (home / "installed.txt").write_text(freeze.stdout)
    return home, ""


# -- starting ------------------------------------------------------------------------------------------------


@dataclass
class Way:
    """One way to the engine: its URL, the key it wants, its process (None for the engine directly)."""
    name: str
    url: str
    key: str | None = None
    process: subprocess.Popen | None = None
    note: str = ""  # what it is, for the report


def peer_env(**extra: str) -> dict:
    """An environment with nothing of the bench's: no database, Redis or console settings reach a peer."""
    keep = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR") if name in os.environ}
    return {**keep, **extra}


def spawn(argv: list, work: Path, name: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([str(a) for a in argv], cwd=work, env=env, stdin=subprocess.DEVNULL,
                            stdout=open(work / f"{name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float) -> str:
    """An empty string once ``url`` answers 200, else why not (with the end of the process's log)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return ""
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    tail = " | ".join(line.strip() for line in log.read_text(errors="replace").splitlines()[-6:] if line.strip())
    state = f"stopped with exit status {process.returncode}" if process.poll() is not None else f"not ready in {timeout:.0f} s"
    return f"{state}: {tail}"


def vllm_router_start(home: Path, engine_url: str, work: Path) -> tuple[Way, str]:
    port, metrics = base.free_port(), base.free_port()
    argv = [home / "bin" / "vllm-router", "--host", "127.0.0.1", "--port", port, "--worker-urls", engine_url,
            "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", metrics,
            "--log-level", "warning"]
    process = spawn(argv, work, "vllm-router", peer_env())
    url = f"http://127.0.0.1:{port}"
    return Way("vllm-router", url, None, process, "round_robin"), wait_ready(f"{url}/health", process,
                                                                               work / "vllm-router.log", 120)


def litellm_config(model: str, engine_url: str, master_key: str) -> str:
    """LiteLLM's config.yaml (JSON is YAML): one model, the engine as an OpenAI-compatible backend, a master key."""
    return json.dumps({
        "model_list": [{"model_name": model, "litellm_params": {
            "model": f"openai/{model}", "api_base": f"{engine_url}/v1", "api_key": "none"}}],
        "litellm_settings": {"telemetry": False},
        "general_settings": {"master_key": master_key}}, indent=2)


def litellm_start(home: Path, engine_url: str, model: str, work: Path) -> tuple[Way, str]:
    port = base.free_port()
    key = "sk-" + secrets.token_hex(16)
    config = work / "litellm-config.yaml"
    config.write_text(litellm_config(model, engine_url, key))
    offline = {name: "True" for name in ("LITELLM_LOCAL_MODEL_COST_MAP", "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS",
                                         "LITELLM_LOCAL_AUTOROUTER_PRESETS", "LITELLM_LOCAL_BLOG_POSTS",
                                         "LITELLM_LOCAL_POLICY_TEMPLATES")}
    env = peer_env(**offline, LITELLM_OFFLINE_MODE="true", LITELLM_LOG="ERROR", LITELLM_MODE="PRODUCTION")
    argv = [home / "bin" / "litellm", "--config", config, "--host", "127.0.0.1", "--port", port, "--num_workers", "1"]
    process = spawn(argv, work, "litellm", env)
    url = f"http://127.0.0.1:{port}"
    return Way("litellm", url, key, process, "uvicorn, 1 worker"), wait_ready(f"{url}/health/liveliness", process,
                                                                               work / "litellm.log", 240)


def gateway_start(work: Path, env: dict, workers: int, key: str) -> tuple[Way, str]:
    """One more gateway, as ``faden serve`` starts it, with ``workers`` processes on one port."""
    from console.management.commands.serve import gateway_argv

    port = base.free_port()
    argv = gateway_argv(base.PYTHON, bind="127.0.0.1", port=port, workers=workers)
    process = subprocess.Popen(argv, cwd=base.ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=open(work / f"gateway-{workers}.log", "w"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    return (Way(gateway_column(workers), url, key, process, f"{workers} workers"),
            wait_ready(f"{url}/health", process, work / f"gateway-{workers}.log", 60))


def gateway_column(workers: int) -> str:
    return "gateway" if workers == 1 else f"gateway x{workers}"


# -- measuring ----------------------------------------------------------------------------------------------


def proc_stat(text: str) -> tuple[int, int]:
    """The parent's pid and the CPU ticks (user and system, its own and its reaped children's) in the text of
    /proc/<pid>/stat."""
    fields = text.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return int(fields[1]), sum(int(value) for value in fields[11:15])


def descendants(parents: dict[int, int], root: int) -> set[int]:
    """``root`` and every process below it, from a map of pid to parent pid."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and all its descendants so far."""
    parents, ticks = {}, {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    parents[int(entry.name)], ticks[int(entry.name)] = proc_stat(stat.read())
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    return sum(ticks.get(pid, 0) for pid in descendants(parents, root)) / TICKS


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


async def run(url: str, request: bytes, *, concurrency: int, requests: int, seconds: float) -> dict:
    """``base.run`` with two things a slow router needs: the connections are warmed all at once (one after the
    other, the first would idle past a keep-alive of 5 s while a router at 60 ms a request warms 64), and a
    kept-alive connection the router closed before answering is opened again and the request sent again, as
    HTTP clients do (counted: ``reopened``); an answer cut in its middle counts as failed."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connections = [base.Connection(host, int(port)) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in connections))
    await asyncio.gather(*(c.post(request) for c in connections))  # warm, not counted
    results: list[tuple[int, float, float]] = []
    counts = {"reopened": 0, "cut": 0}
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()

    async def worker(connection: base.Connection) -> None:
        while len(results) < requests and time.perf_counter() < deadline:
            try:
                results.append(await connection.post(request))
                continue
            except (asyncio.IncompleteReadError, ConnectionError) as error:
                cut = bool(getattr(error, "partial", b""))
            counts["cut" if cut else "reopened"] += 1
            connection.close()
            await connection.open()
            if cut:
                results.append((0, 0.0, 0.0))

    await asyncio.gather(*(worker(c) for c in connections))
    elapsed = time.perf_counter() - started
    for connection in connections:
        connection.close()
    answered = [r for r in results if r[0] == 200]  # a refusal answered fast is not a request served
    return {"requests": len(results), "failed": sum(1 for status, _, _ in results if status != 200), "seconds": elapsed,
            "rps": len(answered) / elapsed, "reopened": counts["reopened"],
            "latency": sorted(total for _, _, total in answered), "first": sorted(first for _, first, _ in answered)}


def measure(way: Way, request: bytes, engine_pid: int | None, *, concurrency: int, requests: int, seconds: float) -> dict:
    watched = {"router": way.process.pid if way.process else None, "engine": engine_pid}
    before = {name: tree_cpu_seconds(pid) for name, pid in watched.items() if pid}
    client = own_cpu_seconds()
    result = asyncio.run(run(way.url, request, concurrency=concurrency, requests=requests, seconds=seconds))
    result["cpu_seconds"] = {name: tree_cpu_seconds(watched[name]) - value for name, value in before.items()}
    result["cpu_seconds"]["client"] = own_cpu_seconds() - client
    return result


def merged(total: dict | None, one: dict) -> dict:
    """Rounds of one path put together."""
    if total is None:
        return one
    requests, seconds = total["requests"] + one["requests"], total["seconds"] + one["seconds"]
    latency = sorted(total["latency"] + one["latency"])
    return {"requests": requests, "failed": total["failed"] + one["failed"], "seconds": seconds, "rps": len(latency) / seconds,
            "reopened": total["reopened"] + one["reopened"],
            "latency": latency, "first": sorted(total["first"] + one["first"]),
            "cpu_seconds": {name: total["cpu_seconds"][name] + one["cpu_seconds"][name] for name in one["cpu_seconds"]}}


def measure_all(ways: list[Way], engine_pid: int | None, model: str, *, rounds: int, requests: int, seconds: float) -> dict:
    """Every path, answered whole and streamed, at each concurrency: {(kind, concurrency): {path: result}}."""
    results = {}
    for kind in KINDS:
        for concurrency in CONCURRENCY:
            by_path: dict[str, dict] = {}
            for turn in range(rounds):
                for way in ways[turn % len(ways):] + ways[:turn % len(ways)]:
                    request = base.request_bytes(way.url, way.key, stream=kind == "stream", model=model)
                    one = measure(way, request, engine_pid, concurrency=concurrency, requests=max(1, requests // rounds),
                                  seconds=seconds / rounds)
                    by_path[way.name] = merged(by_path.get(way.name), one)
            results[(kind, concurrency)] = by_path
            print(f"  {kind} at {concurrency} concurrent: "
                  + ", ".join(f"{name} {r['rps']:.0f}/s" for name, r in by_path.items()), file=sys.stderr, flush=True)
    return results


# -- the figures, the table and the goals -------------------------------------------------------------------


def figures(results: dict) -> dict[str, dict]:
    """Per path: latency at 1 concurrent and what it adds to the engine's, the first chunk, requests per second,
    and the router's CPU per request and in cores at 64 concurrent."""
    q = base.quantile
    direct = results[("whole", 1)]["direct"]
    found = {}
    for name in results[("whole", 1)]:
        one, streamed = results[("whole", 1)][name], results[("stream", 1)][name]
        f = {"p50_ms": q(one["latency"], .5) * 1000, "p99_ms": q(one["latency"], .99) * 1000,
             "first_p50_ms": q(streamed["first"], .5) * 1000, "first_p99_ms": q(streamed["first"], .99) * 1000,
             "rps": {f"{kind}-{c}": results[(kind, c)][name]["rps"] for kind in KINDS for c in CONCURRENCY if c > 1},
             "failed": sum(r[name]["failed"] for r in results.values()),
             "requests": sum(r[name]["requests"] for r in results.values()),
             "reopened": sum(r[name]["reopened"] for r in results.values())}
        f["added_p50_ms"] = f["p50_ms"] - q(direct["latency"], .5) * 1000
        f["added_p99_ms"] = f["p99_ms"] - q(direct["latency"], .99) * 1000
        f["cpu_us"], f["cores"] = {}, {}
        for kind in KINDS:
            r = results[(kind, 64)][name]
            if "router" in r["cpu_seconds"]:
                f["cpu_us"][f"{kind}-64"] = r["cpu_seconds"]["router"] / max(1, r["requests"]) * 1e6
                f["cores"][f"{kind}-64"] = r["cpu_seconds"]["router"] / r["seconds"]
        found[name] = f
    return found


ROWS = (
    ("latency p50 / p99, 1 concurrent, whole (ms)", lambda f: f"{f['p50_ms']:.2f} / {f['p99_ms']:.2f}"),
    ("added p50 / p99 to the engine's (ms)", lambda f: f"{f['added_p50_ms']:+.2f} / {f['added_p99_ms']:+.2f}"),
    ("first chunk p50 / p99, 1 concurrent (ms)", lambda f: f"{f['first_p50_ms']:.2f} / {f['first_p99_ms']:.2f}"),
    ("requests/s, 16 concurrent, whole", lambda f: f"{f['rps']['whole-16']:,.0f}"),
    ("requests/s, 16 concurrent, streamed", lambda f: f"{f['rps']['stream-16']:,.0f}"),
    ("requests/s, 64 concurrent, whole", lambda f: f"{f['rps']['whole-64']:,.0f}"),
    ("requests/s, 64 concurrent, streamed", lambda f: f"{f['rps']['stream-64']:,.0f}"),
    ("router CPU per request, 64 conc., whole (us)", lambda f: f"{f['cpu_us']['whole-64']:,.0f}" if f["cpu_us"] else "-"),
    ("router CPU per request, 64 conc., streamed (us)", lambda f: f"{f['cpu_us']['stream-64']:,.0f}" if f["cpu_us"] else "-"),
    ("router CPU at 64 conc., whole / streamed (cores)",
     lambda f: f"{f['cores']['whole-64']:.2f} / {f['cores']['stream-64']:.2f}" if f["cores"] else "-"),
    ("failed / all requests (connections it closed)", lambda f: f"{f['failed']} / {f['requests']:,} ({f['reopened']})"),
)


def table(found: dict[str, dict], columns: list[str], missing: dict[str, str]) -> str:
    """The paths side by side, one column each (a peer that could not run: "not run"), as Markdown."""
    lines = ["| | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    for label, cell in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(found[c]) if c in found else "not run" for c in columns) + " |")
    return "\n".join(lines)


def goals(found: dict[str, dict], ours: list[str], missing: dict[str, str]) -> list[str]:
    """The issue's goals, each met or not, for each of the gateway's columns."""
    lines = []
    router, litellm = found.get("vllm-router"), found.get("litellm")
    for name in ours:
        g = found[name]
        if router is None:
            lines.append(f"{name} against vllm-router: not judged, vllm-router did not run ({missing.get('vllm-router', '')})")
        else:
            checks = [("added p50", g["added_p50_ms"] <= router["added_p50_ms"], f"{g['added_p50_ms']:+.2f} against {router['added_p50_ms']:+.2f} ms"),
                      ("added p99", g["added_p99_ms"] <= router["added_p99_ms"], f"{g['added_p99_ms']:+.2f} against {router['added_p99_ms']:+.2f} ms"),
                      ("requests/s at 64, whole", g["rps"]["whole-64"] >= router["rps"]["whole-64"],
                       f"{g['rps']['whole-64']:,.0f} against {router['rps']['whole-64']:,.0f}"),
                      ("requests/s at 64, streamed", g["rps"]["stream-64"] >= router["rps"]["stream-64"],
                       f"{g['rps']['stream-64']:,.0f} against {router['rps']['stream-64']:,.0f}")]
            for what, ok, figures_ in checks:
                lines.append(f"{name} against vllm-router, {what}: {'met' if ok else 'NOT MET'} ({figures_})")
        if litellm is None:
            lines.append(f"{name} ahead of litellm: not judged, litellm did not run ({missing.get('litellm', '')})")
        else:
            behind = [what for what, ours_, theirs, lower in (
                ("added p50", g["added_p50_ms"], litellm["added_p50_ms"], True),
                ("added p99", g["added_p99_ms"], litellm["added_p99_ms"], True),
                ("first chunk p50", g["first_p50_ms"], litellm["first_p50_ms"], True),
                ("first chunk p99", g["first_p99_ms"], litellm["first_p99_ms"], True),
                *((f"requests/s {key}", g["rps"][key], litellm["rps"][key], False) for key in g["rps"]),
                *((f"CPU per request {key}", g["cpu_us"][key], litellm["cpu_us"][key], True) for key in g["cpu_us"]))
                if (ours_ > theirs if lower else ours_ < theirs)]
            lines.append(f"{name} ahead of litellm on every figure: " + ("met" if not behind else f"NOT MET (behind on {', '.join(behind)})"))
    return lines


# -- the run ------------------------------------------------------------------------------------------------


def compare(args, *, work: Path, env: dict, engine_url: str, engine: subprocess.Popen | None, what: str,
            gateway_url: str, gateway: subprocess.Popen, secret: str, started: list) -> dict:
    """Install and start the peers, measure the four (or more) paths, print the table and the goals; the figures."""
    workers = sorted({int(n) for n in str(args.gateway_workers).split(",") if n.strip()})
    if not workers or workers[0] < 1:
        sys.exit("--gateway-workers takes counts of 1 or more, e.g. 1,2")
    ways = [Way("direct", engine_url)]
    missing: dict[str, str] = {}
    for count in workers:
        if count == 1:
            ways.append(Way("gateway", gateway_url, secret, gateway, "1 worker"))
            continue
        way, failed = gateway_start(work, env, count, secret)
        started.append(way.process)
        if failed:
            sys.exit(f"The gateway with {count} workers {failed}")
        ways.append(way)
    ours = [way.name for way in ways[1:]]
    cache = Path(args.peers_cache).expanduser()
    for peer in PEERS:
        home, reason = peer_install(peer, cache)
        if home is None:
            missing[peer.name] = f"{peer.pinned} could not be installed: {reason}"
            print(f"{peer.name}: {missing[peer.name]}", file=sys.stderr)
            continue
        starter = vllm_router_start(home, engine_url, work) if peer.name == "vllm-router" else \
            litellm_start(home, engine_url, args.model, work)
        way, failed = starter
        started.append(way.process)
        if failed:
            missing[peer.name] = f"{peer.pinned} did not start: {failed}"
            print(f"{peer.name}: {missing[peer.name]}", file=sys.stderr)
            continue
        ways.append(way)
    load_before = os.getloadavg()
    print(f"Measuring {', '.join(w.name for w in ways)}: {len(KINDS) * len(CONCURRENCY)} figures, {args.seconds:g} s each "
          f"per path in {(args.rounds or 3)} rounds ...", file=sys.stderr, flush=True)
    results = measure_all(ways, engine.pid if engine else None, args.model, rounds=max(1, (args.rounds or 3)),
                          requests=args.requests, seconds=args.seconds)
    load_after = os.getloadavg()
    found = figures(results)
    columns = [w.name for w in ways] + [name for name in missing]
    versions = ", ".join(f"{p.name} {p.version}" for p in PEERS)
    notes = {w.name: w.note for w in ways if w.note}
    lines = [f"Engine: {what}",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; load average "
             f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (1 min)",
             f"Peers: {versions}; " + "; ".join(f"{name}: {note}" for name, note in notes.items()),
             f"{args.seconds:g} s per figure and path in {(args.rounds or 3)} rounds (at most {args.requests:,} requests)", "",
             table(found, columns, missing), ""]
    lines += [f"{name}: {reason}" for name, reason in missing.items()]
    lines += goals(found, ours, missing)
    print("\n".join(lines))
    return {"engine": what, "peers": {p.name: p.version for p in PEERS}, "missing": missing, "notes": notes,
            "load": [load_before[0], load_after[0]], "figures": found}
