"""The gateway's background work, beside its request path (``app.py``): the loops that keep its tables
and report what it saw, so that no request waits on the database or Redis.

- refresh, every FADEN_GATEWAY_REFRESH seconds: the routes and keys read in the database thread (one
  connection, kept), with the keys' last use written there first;
- flush, every second: figures, failure reports and the process's state written to Redis in a thread of
  its own (neither thread waits on the other), and the keys' counts shared with the other processes
  (``limits.py``: the limits' windows, the usage per key);
- probe, every FADEN_GATEWAY_PROBE seconds: each copy out of rotation asked for its ``/health``, a 200 puts
  it back;
- the client certificate the gateway presents to copies behind mutual TLS (deployments/copy_tls.py): loaded
  in the database thread when the first such copy is routed, and looked at again every ``TLS_LOOK_EVERY``
  seconds (renewed when it is due: new connections present the new one).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

from deployments.gateway import failures, limits, traffic, upstream
from deployments.gateway.prefix import DEFAULT_BLOCK, DEFAULT_BOUND, DEFAULT_ENTRIES, CacheAware
from deployments.gateway.routes import CopyRoute, DeploymentRoute, RouteTable, Snapshot, snapshot_load

log = logging.getLogger("fadenstack.gateway")

KEY_USE_WRITTEN_EVERY = 60.0  # seconds: a key's last_used_at is written at most this often
TLS_LOOK_EVERY = 300.0  # seconds between two looks at the client certificate (its renewal)


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str
    prefix: str  # of the gateway's Redis keys (FADEN_GATEWAY_REDIS_PREFIX)
    refresh_every: float = 0.5  # seconds between two reads of the routes and keys
    flush_every: float = 1.0  # seconds between two writes of the figures and failure reports
    probe_every: float = 1.0  # seconds between two looks at the /health of copies out of rotation
    connect_timeout: float = 2.0
    read_timeout: float = 600.0  # a non-streamed answer; a stream waits as long as the copy takes
    max_body: int = 32 * 1024 * 1024
    prefix_entries: int = DEFAULT_ENTRIES  # cache-aware routing: keys of prompts' prefixes kept (prefix.py)
    prefix_bound: int = DEFAULT_BOUND  # requests in flight a copy holding a prefix may have above the least busy
    prefix_block: int = DEFAULT_BLOCK  # characters a block of a prompt

    @classmethod
    def from_settings(cls) -> GatewayConfig:
        from django.conf import settings

        return cls(redis_url=settings.REDIS_URL, prefix=settings.FADEN_GATEWAY_REDIS_PREFIX,
                   refresh_every=settings.FADEN_GATEWAY_REFRESH, probe_every=settings.FADEN_GATEWAY_PROBE,
                   connect_timeout=settings.FADEN_GATEWAY_CONNECT_TIMEOUT, read_timeout=settings.FADEN_GATEWAY_READ_TIMEOUT,
                   max_body=settings.FADEN_GATEWAY_MAX_BODY, prefix_entries=settings.FADEN_GATEWAY_PREFIX_ENTRIES,
                   prefix_bound=settings.FADEN_GATEWAY_PREFIX_BOUND, prefix_block=settings.FADEN_GATEWAY_PREFIX_BLOCK)


class BackgroundWork:
    """What the request path shares with the loops: the table it routes by (refreshed in place), the
    figures and failure reports it adds to (taken away whole at each flush), the keys it saw used."""

    def __init__(self, config: GatewayConfig, *, load=snapshot_load):
        self.config = config
        self.load = load
        self.table = RouteTable(CacheAware(entries=config.prefix_entries, bound=config.prefix_bound,
                                           block=config.prefix_block))
        self.counts = traffic.Counts()
        self.limits = limits.Limits()  # the keys' windows and usage, shared through Redis at each flush
        self.reports: list[dict] = []  # failure reports not yet written to Redis
        self.keys_used: dict[int, float] = {}  # key id -> when last used, since the last refresh
        self.keys_written: dict[int, float] = {}  # key id -> when its last_used_at was last written
        self.process = f"{socket.gethostname()}:{os.getpid()}"
        self.refreshed_at: float | None = None
        self.refresh_error = ""
        self.flush_error = ""
        self.pool: upstream.Pool | None = None
        self.tasks: list[asyncio.Task] = []
        # One thread for the database (one connection, kept), one for Redis: neither waits on the other.
        self.db_thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-db")
        self.redis_thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-redis")
        self.redis = None
        self.tls = None  # deployments.copy_tls.ClientContext, once a copy behind TLS is routed
        self.tls_looked_at = 0.0
        self.tls_error = ""

    async def start(self, pool: upstream.Pool) -> None:
        """The first tables (so the first request finds its routes), then the loops."""
        self.pool = pool
        self.redis = traffic.redis_client(self.config.redis_url)
        await self.refresh()
        self.tasks = [asyncio.create_task(self._every(self.config.refresh_every, self.refresh)),
                      asyncio.create_task(self._every(self.config.flush_every, self.flush)),
                      asyncio.create_task(self._every(self.config.probe_every, self.probe))]
        log.info("Gateway %s up: %d deployments, %d serving copies, %d keys", self.process,
                 len(self.table.deployments), len(self.table.copies), len(self.table.keys))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        await self.flush()  # the last second's figures and reports
        await asyncio.get_running_loop().run_in_executor(self.db_thread, _database_close)
        self.db_thread.shutdown(wait=False)
        self.redis_thread.shutdown(wait=False)

    async def _every(self, seconds: float, work) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await work()
            except Exception:  # a loop that stops would leave the gateway blind: log it and go on
                log.exception("Gateway background work failed: %s", getattr(work, "__name__", work))

    # -- the tables ----------------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the routes and keys in the database thread (and write the keys' last use); apply them here."""
        now = time.time()
        used = {pk: at for pk, at in self.keys_used.items() if now - self.keys_written.get(pk, 0.0) >= KEY_USE_WRITTEN_EVERY}
        self.keys_used = {}
        for pk in used:
            self.keys_written[pk] = now
        try:
            snapshot = await asyncio.get_running_loop().run_in_executor(self.db_thread, self._read_tables, used)
        except Exception as exc:  # the last tables stay in force; said once, not twice a second
            words = f"{type(exc).__name__}: {exc}"
            if words != self.refresh_error:
                log.error("The gateway could not read its routes (it keeps the last ones): %s", words)
            self.refresh_error = words
            for pk in used:
                self.keys_written.pop(pk, None)
            return
        if self.refresh_error:
            log.info("The gateway reads its routes again.")
        self.refresh_error = ""
        self.refreshed_at = time.time()
        changes = self.table.apply(snapshot)
        if snapshot.copy_tls and (self.tls is None or time.monotonic() - self.tls_looked_at > TLS_LOOK_EVERY):
            await self.tls_load()
        for copy in changes["added"]:
            log.info("Routing %s to copy #%d at %s", copy.deployment, copy.number, copy.url)
        for copy in changes["removed"]:
            log.info("No longer routing %s to copy #%d at %s", copy.deployment, copy.number, copy.url)

    def _read_tables(self, used: dict[int, float]) -> Snapshot:
        """In the database thread: last use of the keys used lately, then the tables."""
        from django.db import connection

        try:
            if used:
                from deployments.models import GatewayKey

                at = datetime.fromtimestamp(max(used.values()), UTC)
                GatewayKey.objects.filter(pk__in=list(used)).update(last_used_at=at)
            return self.load()
        except Exception:
            connection.close()  # a broken connection is opened again on the next try
            raise

    async def tls_load(self) -> None:
        """The client certificate (renewed by console/pki.py when due), in the database thread: it reads files."""
        from deployments.copy_tls import client_context

        self.tls_looked_at = time.monotonic()
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(self.db_thread, client_context)
        except Exception as exc:  # the copies behind TLS cannot be called until it loads: said once
            words = f"{type(exc).__name__}: {exc}"
            if words != self.tls_error:
                log.error("The gateway cannot load its client certificate for the copies behind TLS: %s", words)
            self.tls_error = words
            return
        if self.tls is None or loaded.not_after != self.tls.not_after:
            log.info("The gateway presents its client certificate (valid until %s) to the copies behind TLS.",
                     loaded.not_after.isoformat() if loaded.not_after else "?")
            self.tls = loaded
        self.tls_error = ""

    def tls_for(self, copy: CopyRoute):
        """The context to call ``copy`` with: None for a plain copy; ConnectFailed while none could be loaded."""
        if not copy.tls:
            return None
        if self.tls is None:
            raise upstream.ConnectFailed(f"the gateway has no client certificate for it ({self.tls_error or 'not loaded yet'})")
        return self.tls.context

    # -- figures and reports -------------------------------------------------------------------------------

    async def flush(self) -> None:
        await self.limits.flush(self._in_redis_thread, self.redis, self.config.prefix)  # says its own errors
        counts, self.counts = self.counts, traffic.Counts()
        reports, self.reports = self.reports, []
        state = {
            "deployments": len(self.table.deployments), "copies": len(self.table.copies), "keys": len(self.table.keys),
            "out_of_rotation": [{"copy": c.id, "name": c.deployment, "number": c.number, "url": c.url, "why": c.out_reason}
                                for c in self.table.out_of_rotation()],
            "routes_read_at": self.refreshed_at, "routes_error": self.refresh_error,
            # Copies out of the routes still answering this process's requests: a drain ends its grace once none.
            "leaving": {str(pk): count for pk, count in self.table.leaving_in_flight().items()},
        }
        try:
            await asyncio.get_running_loop().run_in_executor(self.redis_thread, self._write, counts, reports, state)
        except Exception as exc:
            words = f"{type(exc).__name__}: {exc}"
            if words != self.flush_error:  # said once, not every second
                log.warning("The gateway could not write its figures to Redis (they are lost while it cannot): %s", words)
            self.flush_error = words
            self.reports = (reports + self.reports)[-failures.KEEP:]  # reports are sent again next time
            return
        if self.flush_error:
            log.info("The gateway writes its figures to Redis again.")
        self.flush_error = ""

    def _in_redis_thread(self, fn, *args):
        return asyncio.get_running_loop().run_in_executor(self.redis_thread, fn, *args)

    def _write(self, counts: traffic.Counts, reports: list[dict], state: dict) -> None:
        failures.failure_report(self.redis, self.config.prefix, reports)
        traffic.counts_flush(self.redis, self.config.prefix, counts)
        traffic.process_alive(self.redis, self.config.prefix, self.process, state)

    def copy_failed(self, route: DeploymentRoute, copy: CopyRoute, words: str) -> None:
        """Out of rotation at once; reported to the console once per time it goes out."""
        if copy.take_out(words):
            log.warning("Copy #%d of %s at %s is out of rotation: %s", copy.number, copy.deployment, copy.url, words)
            self.reports.append({"copy": copy.id, "deployment": route.id, "name": copy.deployment, "number": copy.number,
                                 "url": copy.url, "error": words, "at": datetime.now(UTC).isoformat(timespec="seconds"),
                                 "gateway": self.process})

    async def probe(self) -> None:
        """Ask each copy out of rotation for its /health; a 200 puts it back. Closes connections long unused."""
        self.pool.sweep()
        out = self.table.out_of_rotation()
        if out:
            await asyncio.gather(*(self._probe(copy) for copy in out))

    async def _probe(self, copy: CopyRoute) -> None:
        head = upstream.request_head("GET", "/health", copy.host, copy.port, upstream.copy_auth(copy.api_key), None)
        try:
            response = await self.pool.request(copy.host, copy.port, head, b"", timeout=self.config.connect_timeout,
                                               tls=self.tls_for(copy))
            try:
                while await response.read(self.config.connect_timeout):
                    pass
            finally:
                response.close()
        except upstream.UpstreamError:
            return
        if response.status == 200 and copy.out:
            copy.put_back()
            log.info("Copy #%d of %s at %s answers its health check: back in rotation", copy.number, copy.deployment,
                     copy.url)


def _database_close() -> None:
    from django.db import connection

    connection.close()
