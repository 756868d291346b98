"""The keys' limits in the gateway (deployments/gateway/limits.py): decided from memory with a clock of the
test's own (no sleeps), the sliding window moving, two gateway processes limited together once their counts
met in Redis (the real Redis at REDIS_URL, under a prefix of each test's own), tokens read from the answers
(the reading itself: tests/unit/test_gateway_answer.py)."""
import asyncio
import json
import uuid

import pytest

from deployments.gateway import limits, traffic
from deployments.gateway.limits import Limits
from deployments.gateway.routes import KeyEntry, RouteTable, Snapshot
from tests.unit.test_gateway_answer import answer_of

START = 1_800_000_000 // 60 * 60  # a minute's start


class Clock:
    def __init__(self, at: float = START):
        self.at = at

    def __call__(self) -> float:
        return self.at


def key(pk: int = 7, *, requests: int | None = None, tokens: int | None = None) -> KeyEntry:
    return KeyEntry(id=pk, allowed=None, requests_per_minute=requests, tokens_per_minute=tokens,
                    limited=requests is not None or tokens is not None)


def answered(limiter: Limits, entry: KeyEntry, prompt: int, completion: int, *, error: bool = False) -> None:
    """An answer with this usage went back to the client through the gateway's ``Answer``."""
    body = json.dumps({"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"content": "hi"}}],
                       "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}}).encode()
    answer = answer_of([{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]},
                        {"type": "http.response.body", "body": body}])
    limiter.answered(entry, answer.tokens(), error=error)


@pytest.fixture
def redis(settings):
    prefix = f"test-limits-{uuid.uuid4().hex[:10]}"
    client = traffic.redis_client(settings.REDIS_URL)
    yield client, prefix
    names = list(client.scan_iter(f"{prefix}:*"))
    if names:
        client.delete(*names)


def flush(limiter: Limits, client, prefix: str) -> None:
    async def run(fn, *args):
        return fn(*args)

    asyncio.run(limiter.flush(run, client, prefix))


# -- one process ----------------------------------------------------------------------------------------------


def test_a_burst_over_the_requests_limit_gets_429_with_retry_after_in_openais_shape():
    clock = Clock(START + 30)
    limiter = Limits(clock=clock)
    five = key(requests=5)

    let_in = [limiter.admit(five) for _ in range(5)]
    refused = limiter.admit(five)

    assert let_in == [None] * 5
    assert refused is not None and refused.kind == "requests"
    error = json.loads(refused.body)["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded" and error["param"] is None
    assert error["message"].startswith("Rate limit reached for this API key on requests per minute: it may make 5 "
                                       "requests a minute and made 5 in the last minute. Try again in 42 s.")
    headers = dict(refused.headers)
    assert headers[b"retry-after"] == b"42" and refused.retry_after == 42
    assert headers[b"content-type"] == b"application/json" and headers[b"x-ratelimit-limit-requests"] == b"5"
    assert limiter.usage.figures(7, clock()).requests == 5 and limiter.usage.figures(7, clock()).refused == 1


def test_the_window_moves_and_lets_a_refused_key_in_again_when_retry_after_says():
    clock = Clock(START + 30)
    limiter = Limits(clock=clock)
    five = key(requests=5)
    for _ in range(5):
        assert limiter.admit(five) is None
    wait = limiter.admit(five).retry_after

    clock.at += wait - 1
    still = limiter.admit(five)
    clock.at += 1
    again = limiter.admit(five)
    after = limiter.admit(five)

    assert wait == 42, "30 s left of this minute, then 12 s for the minute before to weigh 4 of its 5"
    assert still is not None and still.retry_after == 1
    assert again is None, "the window moved: one more fits"
    assert after is not None, "and only one: this minute counts it"
    clock.at += 120
    assert limiter.admit(five) is None, "two minutes later nothing weighs"


def test_a_request_refused_is_not_counted_so_hammering_does_not_push_the_window_back():
    clock = Clock(START)
    limiter = Limits(clock=clock)
    two = key(requests=2)
    limiter.admit(two), limiter.admit(two)
    first = limiter.admit(two).retry_after
    for _ in range(100):
        assert limiter.admit(two) is not None

    assert limiter.admit(two).retry_after == first
    clock.at += first
    assert limiter.admit(two) is None


def test_retry_after_is_whole_seconds_and_at_least_one():
    assert limits.wait_seconds(previous=0, current=5, elapsed=59.9, allowed=4) == pytest.approx(0.1 + 12)
    refusal = limits.refusal("requests", 5, 5.0, 0.01)
    assert refusal.retry_after == 1 and dict(refusal.headers)[b"retry-after"] == b"1"
    assert limits.refusal("tokens", 5, 5.0, 3.2).retry_after == 4


def test_a_key_without_limits_is_counted_for_its_usage_and_never_refused():
    limiter = Limits(clock=Clock())
    free = key(3)

    assert all(limiter.admit(free) is None for _ in range(10_000))
    assert limiter.windows == {} and limiter.pending == {}, "no window for a key without limits"
    assert limiter.usage.figures(3, START).requests == 10_000


def test_the_tokens_limit_refuses_the_next_requests_once_the_answers_used_the_minutes_tokens():
    clock = Clock(START + 10)
    limiter = Limits(clock=clock)
    budget = key(tokens=100)

    assert limiter.admit(budget) is None
    answered(limiter, budget, 40, 20)
    assert limiter.admit(budget) is None, "60 of 100 used: the next may go"
    answered(limiter, budget, 30, 15)
    refused = limiter.admit(budget)

    assert refused is not None and refused.kind == "tokens"
    error = json.loads(refused.body)["error"]
    assert error["type"] == "tokens" and error["code"] == "rate_limit_exceeded"
    assert "it may use 100 tokens a minute (prompt and completion) and used 105 in the last minute" in error["message"]
    assert dict(refused.headers)[b"x-ratelimit-limit-tokens"] == b"100"
    clock.at += refused.retry_after
    assert limiter.admit(budget) is None, "the window moved past enough of them"
    figures = limiter.usage.figures(budget.id, clock())
    assert (figures.prompt_tokens, figures.completion_tokens, figures.requests, figures.refused) == (70, 35, 3, 1)


def test_an_error_and_a_refusal_are_counted_in_the_keys_usage_by_the_hour():
    clock = Clock(START)
    limiter = Limits(clock=clock)
    one = key(5, requests=1)
    limiter.admit(one)
    answered(limiter, one, 0, 0, error=True)
    limiter.admit(one)
    clock.at += 3600

    limiter.admit(key(5))

    hours = {hour: (f.requests, f.errors, f.refused) for (hour, pk), f in limiter.usage.hours.items() if pk == 5}
    assert hours == {START // 3600: (1, 1, 1), START // 3600 + 1: (1, 0, 0)}


# -- processes sharing through Redis ----------------------------------------------------------------------------


def test_two_gateway_processes_are_limited_together_once_their_counts_met_in_redis(redis):
    client, prefix = redis
    clock = Clock(START + 5)
    a, b = Limits(clock=clock), Limits(clock=clock)
    ten = key(requests=10)

    from_a = [a.admit(ten) for _ in range(6)]
    from_b = [b.admit(ten) for _ in range(4)]
    flush(a, client, prefix)
    flush(b, client, prefix)
    flush(a, client, prefix)

    assert from_a == [None] * 6 and from_b == [None] * 4, "each process saw only its own"
    assert a.admit(ten) is not None and b.admit(ten) is not None, "10 between them: both refuse the 11th"
    assert client.hgetall(f"{prefix}:limits:{int(clock() // 60)}") == {b"7:r": b"10"}
    assert 0 < client.ttl(f"{prefix}:limits:{int(clock() // 60)}") <= limits.KEEP_SECONDS


def test_before_a_flush_each_process_lets_through_up_to_the_limit_the_overshoot_the_notes_bound(redis):
    client, prefix = redis
    clock = Clock(START + 5)
    a, b = Limits(clock=clock), Limits(clock=clock)
    ten = key(requests=10)

    let_in = sum(x.admit(ten) is None for x in (a, b) for _ in range(15))
    flush(a, client, prefix), flush(b, client, prefix), flush(a, client, prefix)

    assert let_in == 20, "2 processes x the limit: what one flush interval can let through at most here"
    assert a.admit(ten) is not None and b.admit(ten) is not None
    clock.at += 60
    assert a.admit(ten) is not None, "the minute before still weighs (20 counted, of 10)"
    clock.at += 60
    assert a.admit(ten) is None and b.admit(ten) is None


def test_a_process_that_never_saw_the_key_learns_its_window_from_the_flush(redis):
    client, prefix = redis
    clock = Clock(START + 1)
    busy, fresh = Limits(clock=clock), Limits(clock=clock)
    three = key(requests=3)
    for _ in range(3):
        busy.admit(three)
    flush(busy, client, prefix)

    flush(fresh, client, prefix)

    assert fresh.windows[7].requests == 3 and fresh.admit(three) is not None


def test_counts_a_failed_flush_could_not_write_go_with_the_next_one(redis):
    client, prefix = redis
    clock = Clock(START + 1)
    limiter = Limits(clock=clock)
    four = key(requests=4)
    limiter.admit(four), limiter.admit(four)

    async def broken(fn, *args):
        raise ConnectionError("Redis went away")

    asyncio.run(limiter.flush(broken, client, prefix))
    assert limiter.flush_error == "ConnectionError: Redis went away"
    limiter.admit(four)
    flush(limiter, client, prefix)

    assert client.hgetall(f"{prefix}:limits:{int(clock() // 60)}") == {b"7:r": b"3"}
    assert client.hget(f"{prefix}:usage:{int(clock() // 3600)}", "7:requests") == b"3"
    assert limiter.windows[7].requests == 3 and limiter.flush_error == ""


def test_a_minute_change_during_the_flush_keeps_the_minute_before_for_the_window(redis):
    client, prefix = redis
    clock = Clock(START + 59.5)
    limiter = Limits(clock=clock)
    five = key(requests=5)
    for _ in range(5):
        limiter.admit(five)

    async def slow(fn, *args):
        result = fn(*args)
        clock.at = START + 60.2  # the round trip crossed the minute, and a request came in the new one
        assert limiter.admit(five) is not None
        return result

    asyncio.run(limiter.flush(slow, client, prefix))

    window = limiter.windows[7]
    assert window.minute == START // 60 + 1 and window.previous_requests == 5 and window.requests == 0


# -- the keys' limits in the route table ------------------------------------------------------------------------


def test_the_route_table_holds_each_keys_limits_and_reads_keys_without_them():
    table = RouteTable()
    table.apply(Snapshot(deployments=(), copies=(), keys=(("a" * 64, 1, (), False, 5, None),
                                                          ("b" * 64, 2, ("llama",), False, None, 1000),
                                                          ("c" * 64, 3, (), False))))

    assert table.keys["a" * 64] == key(1, requests=5)
    assert table.keys["b" * 64].tokens_per_minute == 1000 and table.keys["b" * 64].limited
    assert not table.keys["c" * 64].limited and table.keys["c" * 64].requests_per_minute is None
