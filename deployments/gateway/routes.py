"""The gateway's route and key tables: read from the database in a thread, used by the event loop.

``snapshot_load`` reads what the gateway needs in three small queries (deployments by name, the
serving copies, the keys) and returns plain data; the gateway runs it every
FADEN_GATEWAY_REFRESH seconds in a thread of its own and hands a changed snapshot to
``RouteTable.apply`` on the event loop, so a request reads only in-memory dicts and nothing is locked.

A copy's route keeps its requests in flight and its place in or out of rotation across refreshes,
for as long as the copy keeps its address, port and serving time: a copy started again (a new
``serving_since``) or moved comes back into rotation with a clean slate.

A deployment's ``routing`` says how ``DeploymentRoute.pick`` chooses: the least busy copy, or (cache-aware) the
copy that served the prompt's prefix, through the table's one ``prefix.CacheAware`` (its index outlives refreshes).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from deployments.choices import ROUTED, Routing
from deployments.gateway.prefix import CacheAware
from deployments.gateway.upstream import copy_auth, request_start


@dataclass(eq=False)
class CopyRoute:
    """One serving copy as the gateway sees it."""

    id: int
    number: int
    deployment: str  # the name clients use
    host: str
    port: int
    since: str  # when it started serving: a new value means it was started again
    in_flight: int = 0
    out_since: float | None = None  # monotonic time it was taken out of rotation, None while in it
    out_reason: str = ""
    api_key: str | None = None  # the copy's own key, sent in place of the client's (None: a copy without one)
    tls: bool = False  # it serves mutual TLS: called with the console's client certificate (deployments/copy_tls.py)
    heads: dict[str, bytes] = field(default_factory=dict)  # path -> the request line, Host and the copy's key

    def head(self, path: str) -> bytes:
        """The start of a POST's head to this copy for one of the gateway's paths (made once per path): its request
        line, Host and the copy's own key; the client's headers, the length and the blank line follow."""
        head = self.heads.get(path)
        if head is None:
            head = self.heads[path] = request_start("POST", path, self.host, self.port, copy_auth(self.api_key))
        return head

    def key_set(self, api_key: str | None) -> None:
        if api_key != self.api_key:
            self.api_key = api_key
            self.heads = {}

    @property
    def out(self) -> bool:
        return self.out_since is not None

    @property
    def url(self) -> str:
        return copy_url(self.host, self.port, tls=self.tls)

    def take_out(self, reason: str) -> bool:
        """Out of rotation at once; True when it was in rotation until now."""
        was_in = self.out_since is None
        if was_in:
            self.out_since = time.monotonic()
        self.out_reason = reason
        return was_in

    def put_back(self) -> None:
        self.out_since, self.out_reason = None, ""


@dataclass(eq=False)
class DeploymentRoute:
    """A deployment's name, id and serving copies; ``pick`` chooses where a request goes."""

    id: int
    name: str
    created: int = 0  # when the deployment was made, in Unix seconds (OpenAI's model "created")
    copies: list[CopyRoute] = field(default_factory=list)
    turn: int = 0  # where the next look starts, so that copies tied on requests in flight take turns
    routing: str = Routing.LEAST_BUSY
    cache: CacheAware | None = None  # the table's, when the deployment is routed cache-aware

    def prompt_keys(self, request: dict) -> list[int] | None:
        """The keys of the request's prompt when the deployment is routed cache-aware; None when it is not."""
        return None if self.cache is None else self.cache.keys(self.id, request)

    def pick(self, tried: set[int] | tuple = (), keys: list[int] | None = None) -> CopyRoute | None:
        """Where the request goes, not among ``tried``: with the prompt's ``keys`` (cache-aware), the copy that
        served its prefix unless that copy is over the load bound; else the least busy copy."""
        least = self.least_busy(tried)
        if keys and least is not None and self.cache is not None:
            return self.cache.choose(self.copies, keys, least, tried)
        return least

    def least_busy(self, tried: set[int] | tuple = ()) -> CopyRoute | None:
        """The copy in rotation with the fewest requests in flight, not among ``tried``; ties rotate."""
        copies = self.copies
        count = len(copies)
        if not count:
            return None
        start = self.turn % count
        self.turn = start + 1
        best = None
        for index in range(start, start + count):
            copy = copies[index % count]
            if copy.out_since is not None or copy.id in tried:
                continue
            if best is None or copy.in_flight < best.in_flight:
                best = copy
                if not copy.in_flight:
                    break  # nothing beats an idle copy
        return best

    @property
    def in_rotation(self) -> list[CopyRoute]:
        return [copy for copy in self.copies if copy.out_since is None]


@dataclass(frozen=True)
class KeyEntry:
    """A key the gateway knows: its id (for last used), the names it may use (None: every one), whether it
    was revoked (kept to say so rather than "incorrect"), and its limits a minute (None: none; limits.py)."""

    id: int
    allowed: frozenset[str] | None
    revoked: bool = False
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    limited: bool = False  # either limit set: the request path looks at its window only then

    def may_use(self, name: str) -> bool:
        return self.allowed is None or name in self.allowed


@dataclass(frozen=True)
class Snapshot:
    """What the database says, as plain data (equal snapshots mean nothing changed)."""

    deployments: tuple[tuple[str, int, int], ...]  # (name, id, created in Unix seconds), by name
    copies: tuple[tuple[int, int, int, str, int, str], ...]  # (copy id, deployment id, number, address, port, since)
    # (sha256, key id, limited to names or (), revoked, requests a minute or None, tokens a minute or None)
    keys: tuple[tuple, ...]
    copy_keys: tuple[tuple[int, str], ...] = ()  # (copy id, the copy's own key) for copies that have one
    copy_tls: tuple[int, ...] = ()  # the copies that serve mutual TLS
    routing: tuple[tuple[int, str], ...] = ()  # (deployment id, routing) of the deployments not routed least busy


def copy_url(address: str, port: int, *, tls: bool = False) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{'https' if tls else 'http'}://{host}:{port}"


def snapshot_load() -> Snapshot:
    """The deployments, their serving copies and the keys: three queries, whatever the size."""
    from deployments.models import Copy, Deployment, GatewayKey

    rows = list(Deployment.objects.order_by("name").values_list("name", "id", "created_at", "routing"))
    deployments = tuple((name, pk, int(created.timestamp())) for name, pk, created, _ in rows)
    routing = tuple((pk, how) for _, pk, _, how in rows if how != Routing.LEAST_BUSY)
    copies = tuple(
        (pk, deployment, number, address, port, since.isoformat() if since else "")
        for pk, deployment, number, address, port, since in Copy.objects.filter(
            state__in=ROUTED, address__isnull=False, port__isnull=False,
        ).order_by("deployment_id", "number").values_list("id", "deployment_id", "number", "address", "port", "serving_since")
    )
    copy_keys = _copy_keys(Copy.objects.filter(state__in=ROUTED).exclude(api_key_sealed="").values_list(
        "id", "api_key_sealed"))
    copy_tls = tuple(Copy.objects.filter(state__in=ROUTED, tls=True).order_by("pk").values_list("id", flat=True))
    keys = tuple(
        (digest, pk, tuple(names) if isinstance(names, list) else (), revoked is not None, requests, tokens)
        for pk, digest, names, revoked, requests, tokens in GatewayKey.objects.order_by("pk").values_list(
            "id", "key_hash", "deployments", "revoked_at", "requests_per_minute", "tokens_per_minute")
    )
    return Snapshot(deployments=deployments, copies=copies, keys=keys, copy_keys=copy_keys, copy_tls=copy_tls,
                    routing=routing)


_unsealed: dict[tuple[int, str], str | None] = {}  # (copy id, sealed) -> key: unsealed once, not every refresh


def _copy_keys(rows) -> tuple[tuple[int, str], ...]:
    from deployments.copy_keys import copy_key_of

    global _unsealed
    known = {(pk, sealed): _unsealed[(pk, sealed)] if (pk, sealed) in _unsealed else copy_key_of(pk, sealed)
             for pk, sealed in rows}
    _unsealed = known
    return tuple((pk, key) for (pk, _), key in sorted(known.items()) if key)


def _key_entry(pk: int, names: tuple[str, ...], revoked: bool, requests: int | None = None,
               tokens: int | None = None) -> KeyEntry:
    return KeyEntry(id=pk, allowed=frozenset(names) if names else None, revoked=revoked, requests_per_minute=requests,
                    tokens_per_minute=tokens, limited=requests is not None or tokens is not None)


class RouteTable:
    """The deployments by name with their copies, and the keys by their sha256. Used on the event loop only."""

    def __init__(self, cache: CacheAware | None = None):
        self.cache = cache if cache is not None else CacheAware()  # the process's prefix index, for every deployment
        self.deployments: dict[str, DeploymentRoute] = {}
        self.keys: dict[str, KeyEntry] = {}
        self.copies: dict[int, CopyRoute] = {}
        self.snapshot: Snapshot | None = None
        # Copies that left the routes with requests still in flight (a drain waits for them to finish).
        self.leaving: dict[int, CopyRoute] = {}

    def apply(self, snapshot: Snapshot) -> dict[str, list]:
        """Take in what the database says now; returns the copies that came and went (for the log)."""
        if snapshot == self.snapshot:
            return {"added": [], "removed": []}
        names = {pk: name for name, pk, _ in snapshot.deployments}
        routing = dict(snapshot.routing)
        deployments = {name: DeploymentRoute(id=pk, name=name, created=created, routing=routing.get(pk, Routing.LEAST_BUSY))
                       for name, pk, created in snapshot.deployments}
        for route in deployments.values():
            if route.routing == Routing.CACHE_AWARE:
                route.cache = self.cache
        copies: dict[int, CopyRoute] = {}
        copy_keys = dict(snapshot.copy_keys)
        copy_tls = frozenset(snapshot.copy_tls)
        for pk, deployment_id, number, host, port, since in snapshot.copies:
            name = names.get(deployment_id)
            if name is None:
                continue
            route = self.copies.get(pk)
            tls = pk in copy_tls
            if route is None or (route.host, route.port, route.since, route.tls) != (host, port, since, tls):
                route = CopyRoute(id=pk, number=number, deployment=name, host=host, port=port, since=since, tls=tls)
            route.key_set(copy_keys.get(pk))
            copies[pk] = route
            deployments[name].copies.append(route)
        for name, route in deployments.items():
            if (old := self.deployments.get(name)) is not None:
                route.turn = old.turn
        added = [copies[pk] for pk in copies.keys() - self.copies.keys()]
        removed = [self.copies[pk] for pk in self.copies.keys() - copies.keys()]
        for route in removed:
            if route.in_flight:
                self.leaving[route.id] = route
        self.deployments, self.copies = deployments, copies
        self.keys = {digest: _key_entry(*row) for digest, *row in snapshot.keys}
        self.snapshot = snapshot
        return {"added": added, "removed": removed}

    def serving(self, key: KeyEntry | None = None) -> list[DeploymentRoute]:
        """The deployments with a copy in rotation (that ``key`` may use), by name."""
        return [route for name, route in self.deployments.items()
                if route.in_rotation and (key is None or key.may_use(name))]

    def leaving_in_flight(self) -> dict[int, int]:
        """The copies that left the routes and still answer requests this process sent them: {copy id: how many}."""
        self.leaving = {pk: route for pk, route in self.leaving.items() if route.in_flight > 0 and pk not in self.copies}
        return {pk: route.in_flight for pk, route in self.leaving.items()}

    def out_of_rotation(self) -> list[CopyRoute]:
        return [copy for copy in self.copies.values() if copy.out_since is not None]
