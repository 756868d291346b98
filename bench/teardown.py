"""What the gateway's benches leave behind, taken away: their processes (each in a group of its own), the Redis keys
under their prefix and their working directory."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess


def clean_up(started: list[subprocess.Popen], *, redis_url: str, prefix: str, work) -> None:
    """Stop ``started`` (SIGTERM to each group, last started first; SIGKILL after 15 s), delete ``prefix``'s keys,
    remove ``work``. Never raises: it runs in a ``finally``."""
    for process in reversed(started):
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in started:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    try:
        from deployments.gateway.traffic import redis_client

        client = redis_client(redis_url)
        names = list(client.scan_iter(f"{prefix}:*"))
        if names:
            client.delete(*names)
    except Exception:  # noqa: BLE001 (a Redis gone away leaves keys that expire)
        pass
    shutil.rmtree(work, ignore_errors=True)
