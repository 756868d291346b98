"""Cache-aware routing (deployments/gateway/prefix.py): the prefix index (bounded, the oldest evicted), the same
prefix to the same copy unless it is over the load bound, the routing as the route table carries it, and a
conversation through the gateway to real upstreams."""
import dataclasses
import threading

import pytest

from deployments.choices import Routing
from deployments.gateway.prefix import MAX_BLOCKS, CacheAware, PrefixIndex, prefix_keys, prompt_text
from deployments.gateway.routes import CopyRoute, DeploymentRoute, RouteTable, Snapshot, snapshot_load
from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model
from tests.unit.test_gateway import (a_key, answered_by, redis, serving, start_gateway,  # noqa: F401 (fixtures)
                                     upstreams, wait_for)

SYSTEM = "You answer questions about rivers. " * 60  # about 2,000 characters
BLOCK = 64


def conversation(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    for n, turn in enumerate(turns):
        if n:
            messages.append({"role": "assistant", "content": f"An answer to turn {n}."})
        messages.append({"role": "user", "content": turn})
    return {"model": "llama", "messages": messages}


def copies(*ids: int) -> list[CopyRoute]:
    return [CopyRoute(id=n, number=n, deployment="llama", host="127.0.0.1", port=8100 + n, since="") for n in ids]


def cache_aware(*ids: int, bound: int = 2, entries: int = 1000) -> DeploymentRoute:
    return DeploymentRoute(id=1, name="llama", copies=copies(*ids), routing=Routing.CACHE_AWARE,
                           cache=CacheAware(entries=entries, bound=bound, block=BLOCK))


def send(route: DeploymentRoute, request: dict, tried=()) -> CopyRoute:
    return route.pick(tried, route.prompt_keys(request))


# -- the prompt's keys -------------------------------------------------------------------------------------


def test_a_prompts_keys_chain_its_blocks_so_a_shared_prefix_shares_its_leading_keys():
    first = prompt_text(conversation(SYSTEM, "Where does the Rhine go?"))
    later = prompt_text(conversation(SYSTEM, "Where does the Rhine go?", "And the Danube?"))
    other = prompt_text(conversation(SYSTEM, "Where does the Elbe go?"))
    a, b, c = (prefix_keys(1, text, BLOCK) for text in (first, later, other))

    assert later.startswith(first) and len(a) == len(first) // BLOCK and len(b) > len(a)
    assert b[:len(a)] == a, "the later turn starts with every whole block of the first"
    shared = len(SYSTEM) // BLOCK  # the blocks wholly within the system prompt (and its role before it)
    assert a[:shared] == c[:shared] and shared >= 20
    assert set(a[shared + 1:]).isdisjoint(c), "once a block differs no later key is shared: a key is its whole prefix"
    assert set(prefix_keys(2, first, BLOCK)).isdisjoint(a), "another deployment's keys are its own"
    assert prefix_keys(1, "short", BLOCK) == [], "only whole blocks count"
    assert len(prefix_keys(1, "x" * BLOCK * (MAX_BLOCKS + 5), BLOCK)) == MAX_BLOCKS


def test_the_prompt_is_a_chats_messages_or_a_completions_prompt_and_nothing_for_embeddings():
    chat = prompt_text({"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                                  {"type": "image_url", "image_url": {"url": "x.png"}}]}]})
    assert chat.startswith("\x1esystem\x1fBe brief.\x1euser\x1fLook:") and "x.png" in chat
    assert prompt_text({"prompt": "Once upon a time"}) == "Once upon a time"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "[1, 2, 3]"
    assert prompt_text({"input": "a sentence"}) is None
    assert cache_aware(1).prompt_keys({"input": "a sentence"}) is None
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert cache_aware(1).prompt_keys({"messages": [{"role": "user", "content": deep}]}) is None, "least busy, no error"


# -- the index ----------------------------------------------------------------------------------------------


def test_the_index_is_bounded_and_evicts_the_oldest_keys_first():
    index = PrefixIndex(entries=10)
    index.record([1, 2, 3, 4], copy_id=7)
    index.record([5, 6, 7, 8], copy_id=8)
    index.record([1], copy_id=7)  # used again: the newest now
    index.record([9, 10, 11, 12, 13], copy_id=9)

    assert len(index) == 10
    assert [list(index.holders([key])) for key in (2, 3, 4)] == [[], [], []], "the oldest went first"
    assert list(index.holders([1])) == [7], "a key used again is kept"
    assert list(index.holders([1, 5, 13])) == [9, 8, 7], "the longest prefix first"
    for n in range(1000):
        index.record([10_000 + n, 20_000 + n], copy_id=n)
    assert len(index) == 10 and list(index.holders([10_999, 20_999])) == [999, 999]
    with pytest.raises(ValueError):
        PrefixIndex(entries=0)


def test_the_same_prefix_goes_to_the_same_copy_while_it_is_within_the_load_bound():
    route = cache_aware(1, 2, 3, bound=2)
    first = send(route, conversation(SYSTEM, "Where does the Rhine go?"))
    first.in_flight += 1  # it is answering that turn still
    other = send(route, conversation("Another system prompt entirely. " * 60, "Hello"))
    assert other is not first, "a new prefix goes to the least busy copy"

    first.in_flight += 1  # 2 in flight, the least busy 0: within the bound
    again = [send(route, conversation(SYSTEM, "Where does the Rhine go?", "And the Danube?", f"And river {n}?"))
             for n in range(5)]
    assert again == [first] * 5, "each later turn shares the conversation's prefix: the copy that served it"
    assert route.cache.sent["held"] == 5

    first.in_flight += 1  # 3 above an idle copy: over the bound of 2
    moved = send(route, conversation(SYSTEM, "Where does the Rhine go?", "And the Danube?", "And the Elbe?"))
    assert moved is not first and moved.in_flight == 0 and route.cache.sent["busy"] == 1
    first.in_flight = 0
    assert send(route, conversation(SYSTEM, "Where does the Rhine go?", "And the Danube?", "And the Elbe?")) is moved, \
        "the copy it moved to holds it now"


def test_a_holder_out_of_rotation_or_already_tried_gives_way():
    route = cache_aware(1, 2)
    request = conversation(SYSTEM, "Where does the Rhine go?")
    held = send(route, request)
    assert send(route, request) is held
    assert send(route, request, tried={held.id}) is not held, "a copy that refused this request is not picked again"
    held.take_out("Connection refused")
    assert send(route, request) is not held
    held.put_back()
    assert send(route, request) is not held, "the copy that took it over holds it now"


def test_a_short_prompt_or_a_least_busy_deployment_is_routed_least_busy():
    route = cache_aware(1, 2, 3)
    short = conversation("Hi", "Yo")
    assert route.prompt_keys(short) == [] and [send(route, short).id for _ in range(3)] == [1, 2, 3]
    plain = DeploymentRoute(id=1, name="llama", copies=copies(1, 2, 3))
    request = conversation(SYSTEM, "Where does the Rhine go?")
    assert plain.prompt_keys(request) is None and [send(plain, request).id for _ in range(3)] == [1, 2, 3]


# -- the route table ----------------------------------------------------------------------------------------


def snapshot(routing=()) -> Snapshot:
    return Snapshot(deployments=(("chat", 1, 0), ("llama", 2, 0)),
                    copies=((7, 1, 1, "a", 1, "t"), (8, 1, 2, "b", 1, "t"), (9, 2, 1, "c", 1, "t"), (10, 2, 2, "d", 1, "t")),
                    keys=(), routing=routing)


def test_the_route_table_carries_each_deployments_routing_and_keeps_its_index_across_refreshes():
    table = RouteTable(CacheAware(entries=1000, bound=4, block=BLOCK))
    table.apply(snapshot(routing=((2, "cache-aware"),)))
    chat, llama = table.deployments["chat"], table.deployments["llama"]
    assert (chat.routing, chat.cache) == (Routing.LEAST_BUSY, None)
    assert llama.routing == Routing.CACHE_AWARE and llama.cache is table.cache

    request = conversation(SYSTEM, "Where does the Rhine go?")
    held = send(llama, request)
    table.apply(dataclasses.replace(snapshot(routing=((2, "cache-aware"),)), keys=(("h", 1, (), False),)))  # a refresh
    llama = table.deployments["llama"]
    assert [send(llama, conversation(SYSTEM, "Where does the Rhine go?", f"Turn {n}")).id for n in range(4)] == [held.id] * 4
    assert len(table.cache.index) > 0

    table.apply(snapshot())  # routed least busy again: no keys, the copies take turns
    llama = table.deployments["llama"]
    assert llama.cache is None and llama.prompt_keys(request) is None
    assert {send(llama, request).id for _ in range(4)} == {9, 10}


@pytest.mark.django_db
def test_the_routes_read_a_deployments_routing_from_the_database():
    cluster = cluster_of([gpu_machine("gpu-a", 11)])
    deployment_of(cluster, name="plain")
    aware = deployment_of(cluster, ready_model("org/aware"), name="aware", routing=Routing.CACHE_AWARE)

    loaded = snapshot_load()
    assert loaded.routing == ((aware.pk, "cache-aware"),)
    table = RouteTable()
    table.apply(loaded)
    assert table.deployments["aware"].cache is table.cache and table.deployments["plain"].cache is None


# -- through the gateway ------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_conversations_turns_go_to_one_copy_and_a_new_one_to_the_idle_copy_while_it_is_busy(upstreams, start_gateway):
    a, b = upstreams("a"), upstreams("b")
    llama = deployment_of(cluster_of([gpu_machine("gpu-a", 11)]), name="llama", routing=Routing.CACHE_AWARE)
    serving(llama, a, 1)
    serving(llama, b, 2)
    secret = a_key()
    gateway = start_gateway(prefix_bound=0, prefix_block=BLOCK)
    client = gateway.client(secret)

    turns = ["Where does the Rhine go?"]
    served = []
    for n in range(6):
        served.append(answered_by(client.post("/v1/chat/completions", json=conversation(SYSTEM, *turns))))
        turns.append(f"And then, turn {n}?")
    assert len(set(served)) == 1, f"every turn to the copy that served the first: {served}"
    home = served[0]
    holder, other = (a, b) if home == "a" else (b, a)

    holder.hold = threading.Event()  # the conversation's copy is busy with its next turn
    busy = []
    thread = threading.Thread(target=lambda: busy.append(client.post("/v1/chat/completions",
                                                                      json=conversation(SYSTEM, *turns))))
    thread.start()
    try:
        wait_for(lambda: holder.hold is not None and len(holder.requests) == 7)
        fresh = client.post("/v1/chat/completions", json=conversation("A new system prompt. " * 80, "Hello"))
        assert answered_by(fresh) == other.name, "a new conversation takes the idle copy"
        again = client.post("/v1/chat/completions", json=conversation(SYSTEM, *turns, "Still there?"))
        assert answered_by(again) == other.name, "over the bound (0 here) the turn goes to the least busy copy"
    finally:
        holder.hold.set()
        thread.join(timeout=5)
    assert busy[0].status_code == 200 and answered_by(busy[0]) == home
