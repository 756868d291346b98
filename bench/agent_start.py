#!/usr/bin/env python
"""What one agent command costs a machine: CPU seconds per run of the zipapp the console installs.

    .venv/bin/python bench/agent_start.py                  # version, copy list, runtime status; 20 runs each
    .venv/bin/python bench/agent_start.py --runs 50 --python /usr/bin/python3.11

Every look at a machine (a health check, a copy's start, an image's step) is an SSH session that runs
one agent command, so its start is paid on every machine many times a minute. This builds the agent
as the console does (machines/agent.py), installs it in a directory of its own, and runs each command
--runs times with the machine's Python, twice: as installed (from the copy unpacked beside the zip,
agent/zipmain.py) and from the zip itself (the directory for the copy made impossible, as on a
read-only home). It prints the median and the fastest CPU time (user + system, of the child alone)
and the median wall time of each. No lab and no database: the commands run on this host with a
store of their own.
"""
import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

COMMANDS = (["version"], ["copy", "list"], ["runtime", "status"])


def build(into: Path) -> Path:
    import django

    os.environ["FADEN_DATA_DIR"] = str(into / "data")
    django.setup()
    from machines.agent import agent_build

    installed = into / "agent" / agent_build().filename
    installed.parent.mkdir(parents=True)
    shutil.copyfile(agent_build().path, installed)
    return installed


def one_run(argv: list, env: dict) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--python", default="/usr/bin/python3", help="the machine's Python (default /usr/bin/python3)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fadenstack-bench-agent-"))
    try:
        installed = build(work)
        store = work / "store"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LC_ALL": "C", "FADEN_AGENT_HOME": str(work / "home"),
               "FADEN_AGENT_STORE": str(store), "FADEN_AGENT_CONFIG": str(work / "agent.json")}
        (work / "agent.json").write_text('{"runtime_driver": "process"}')
        print(f"agent {installed.name}, {args.python}, {args.runs} runs each (CPU: user + system of the command)")
        for how in ("unpacked beside the zip", "from the zip"):
            if how == "from the zip":
                shutil.rmtree(installed.parent / ".unpacked", ignore_errors=True)
                (installed.parent / ".unpacked").write_text("no directory can be made here")
            for command in COMMANDS:
                argv = [args.python, str(installed), *command]
                one_run(argv, env)  # the first run unpacks (and compiles) once
                cpu, wall = zip(*(one_run(argv, env) for _ in range(args.runs)))
                print(f"  {how:24} {' '.join(command):15} CPU median {statistics.median(cpu) * 1000:6.1f} ms, "
                      f"fastest {min(cpu) * 1000:6.1f} ms; wall median {statistics.median(wall) * 1000:6.1f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
