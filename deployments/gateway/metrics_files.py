"""The metrics of a gateway's workers added up: prometheus_client's multiprocess files, written in batches.

uvicorn's ``--workers`` share one port, so a scrape reaches any one of them. Each worker writes its figures
(``GatewayMetrics.collect``) into ``<directory>/<type>_<pid>.db``, the files of prometheus_client's
multiprocess mode, every second and before it answers a scrape; the worker a scrape reaches reads them all
(``MultiProcessCollector``). Counters and histograms add up, and a worker that died (uvicorn starts another)
leaves its counts there, so no counter goes back; requests in flight add up over the workers alive (a dead
worker's gauges are removed at the next scrape). The figures are written as they stand, never on a request:
a request costs what it costs with one process, and a scrape sees another worker's figures a second late.

Each gateway (uvicorn's supervisor, the workers' parent) has a directory of its own under
FADEN_GATEWAY_METRICS_DIR, named by its process id: a gateway started again counts from zero, as Prometheus
expects of a restarted target, and the directories of gateways no longer running are removed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from prometheus_client.exposition import generate_latest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import CollectorRegistry

GAUGE_FILES = "gauge_livesum"  # in flight: the sum over the workers alive


def run_directory(base: Path, gateway_pid: int) -> Path:
    """``base/<gateway_pid>``, made; the directories of gateways that stopped are removed."""
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    for child in base.iterdir():
        if child.name.isdigit() and int(child.name) != gateway_pid and not alive(int(child.name)):
            shutil.rmtree(child, ignore_errors=True)  # another worker may be removing it too
    directory = base / str(gateway_pid)
    directory.mkdir(exist_ok=True, mode=0o700)
    return directory


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


class SharedFiles:
    """One worker's figures in the shared directory, and every worker's added up for a scrape."""

    def __init__(self, directory: Path, pid: int):
        self.directory = directory
        self.pid = pid
        self.files: dict[str, MmapedDict] = {}
        self.keys: dict[tuple, str] = {}  # (family, sample, labels) -> the file's key (JSON: made once)
        self.written: dict[str, float] = {}  # key -> the value last written (unchanged values are not written)

    def write(self, families) -> None:
        """This worker's figures as they stand: counters and histograms cumulative, gauges as they are."""
        for family in families:
            prefix = GAUGE_FILES if family.type == "gauge" else family.type
            store = self.files.get(prefix)
            if store is None:
                store = self.files[prefix] = MmapedDict(str(self.directory / f"{prefix}_{self.pid}.db"))
            samples = (_per_bucket(family.samples) if family.type == "histogram"
                       else [(sample.name, sample.labels, sample.value) for sample in family.samples])
            for name, labels, value in samples:
                key = self._key(family, name, labels)
                if self.written.get(key) != value:
                    store.write_value(key, value, 0.0)
                    self.written[key] = value

    def _key(self, family, name: str, labels: dict) -> str:
        lookup = (family.name, name, tuple(labels.items()))
        key = self.keys.get(lookup)
        if key is None:  # prometheus_client's mmap_key, which MultiProcessCollector reads back
            key = self.keys[lookup] = json.dumps([family.name, name, labels, family.documentation], sort_keys=True)
        return key

    def exposition(self) -> bytes:
        """Every worker's figures added up, in Prometheus's text format (reads files: call it off the loop)."""
        for path in self.directory.glob(f"{GAUGE_FILES}_*.db"):
            pid = path.stem.rsplit("_", 1)[-1]
            if pid.isdigit() and int(pid) != self.pid and not alive(int(pid)):
                mark_process_dead(int(pid), str(self.directory))
        registry = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(registry, str(self.directory))
        return generate_latest(registry)

    def close(self) -> None:
        for store in self.files.values():
            store.close()
        self.files = {}


def _per_bucket(samples) -> list[tuple[str, dict, float]]:
    """A histogram's samples as the multiprocess files hold them: each bucket's own count (not cumulative),
    and the sum; the count is the buckets' total, worked out when read."""
    found, previous = [], {}
    for sample in samples:
        if sample.name.endswith("_bucket"):
            series = tuple((k, v) for k, v in sample.labels.items() if k != "le")
            found.append((sample.name, sample.labels, sample.value - previous.get(series, 0.0)))
            previous[series] = sample.value
        elif sample.name.endswith("_sum"):
            found.append((sample.name, sample.labels, sample.value))
    return found
