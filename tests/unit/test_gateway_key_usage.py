"""Limits and usage per key end to end: through the gateway under uvicorn against a small engine
(tests/upstreams.py), the counts in the real Redis (REDIS_URL, a prefix of each test's own), the hours copied
to the database by the beat task's body and read back by hour."""
from datetime import UTC, datetime, timedelta

import pytest

from deployments import gateway_keys, gateway_usage
from deployments.gateway import key_usage
from deployments.gateway.key_usage import Figures, UsageCounts
from deployments.gateway.routes import snapshot_load
from deployments.models import GatewayKey, KeyUsage
from tests.unit.test_gateway import (CHAT, chat, cluster, redis, serving, start_gateway, upstreams,  # noqa: F401 (fixtures)
                                     wait_for)
from tests.builders import deployment_of

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = 1_800_000_000 // 3600


def a_key(**options) -> tuple[GatewayKey, str]:
    return gateway_keys.gateway_key_create(name=options.pop("name", "tests"), **options)


def test_a_limited_key_gets_429_with_retry_after_through_the_gateway_and_another_key_does_not(
        cluster, upstreams, start_gateway):
    serving(deployment_of(cluster, name="llama"), upstreams("llama"))
    _, limited = a_key(name="five", requests_per_minute=3)
    _, free = a_key(name="free")
    gateway = start_gateway()
    client = gateway.client(limited)

    answers = [chat(client, "llama") for _ in range(4)]
    others = [chat(gateway.client(free), "llama").status_code for _ in range(5)]

    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    refused = answers[-1]
    assert 1 <= int(refused.headers["retry-after"]) <= 120
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and refused.json()["error"]["type"] == "requests"
    assert "it may make 3 requests a minute" in refused.json()["error"]["message"]
    assert others == [200] * 5


def test_the_tokens_limit_counts_the_answers_usage_and_a_streams_when_its_client_asked(cluster, upstreams, start_gateway):
    serving(deployment_of(cluster, name="llama"), upstreams("llama", tokens=5))  # 3 prompt + 5 completion a request
    _, secret = a_key(tokens_per_minute=20)
    gateway = start_gateway()
    client = gateway.client(secret)

    whole = chat(client, "llama")
    streamed = client.post(CHAT, json={"model": "llama", "stream": True, "stream_options": {"include_usage": True},
                                       "messages": [{"role": "user", "content": "hi"}]})
    unasked = client.post(CHAT, json={"model": "llama", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    third = chat(client, "llama")  # 8 + 8 counted (the stream without usage: none): 16 of 20, this one goes
    over = chat(client, "llama")

    assert [whole.status_code, streamed.status_code, unasked.status_code, third.status_code] == [200] * 4
    assert '"usage": {"prompt_tokens": 3' in streamed.text and "usage" not in unasked.text, "the streams as the copy sent them"
    assert over.status_code == 429 and over.json()["error"]["type"] == "tokens"
    assert "used 24 in the last minute" in over.json()["error"]["message"]


def test_a_keys_usage_goes_through_redis_to_the_database_by_the_hour(cluster, upstreams, start_gateway, redis):
    client_redis, prefix = redis
    serving(deployment_of(cluster, name="llama"), upstreams("llama", tokens=5))
    key, secret = a_key(requests_per_minute=2)
    gateway = start_gateway()
    client = gateway.client(secret)
    statuses = [chat(client, "llama").status_code, chat(client, "llama", "fail").status_code, chat(client, "llama").status_code]

    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    wait_for(lambda: client_redis.hget(f"{prefix}:usage:{int(hour.timestamp()) // 3600}", f"{key.pk}:refused"))
    copied = gateway_usage.usage_copy(client=client_redis, prefix=prefix)

    assert statuses == [200, 500, 429]
    assert copied == 1
    row = KeyUsage.objects.get(key=key)
    assert row.hour == hour
    assert (row.requests, row.errors, row.refused, row.prompt_tokens, row.completion_tokens) == (2, 1, 1, 3, 5)
    assert gateway_usage.usage_copy(client=client_redis, prefix=prefix) == 0, "nothing new: nothing written"


def test_the_copy_sets_each_hour_to_redis_totals_so_running_it_again_does_not_add(redis):
    client, prefix = redis
    key, _ = a_key()
    counts = UsageCounts()
    counts.hours[(HOUR, key.pk)] = Figures(requests=4, errors=1, prompt_tokens=40, completion_tokens=12)
    counts.hours[(HOUR + 1, key.pk)] = Figures(requests=1, refused=2)
    counts.hours[(HOUR, 987654)] = Figures(requests=9)  # a key this console does not have
    write(client, prefix, counts)

    assert gateway_usage.usage_copy(client=client, prefix=prefix) == 2
    more = UsageCounts()
    more.hours[(HOUR + 1, key.pk)] = Figures(requests=3)
    write(client, prefix, more)
    client.sadd(f"{prefix}:usage:dirty", HOUR)  # an hour named twice (a retried run) changes nothing
    gateway_usage.usage_copy(client=client, prefix=prefix)

    rows = {row.hour: (row.requests, row.errors, row.refused, row.prompt_tokens, row.completion_tokens)
            for row in KeyUsage.objects.filter(key=key)}
    assert rows == {datetime.fromtimestamp(HOUR * 3600, UTC): (4, 1, 0, 40, 12),
                    datetime.fromtimestamp((HOUR + 1) * 3600, UTC): (4, 0, 2, 0, 0)}
    assert 0 < client.ttl(f"{prefix}:usage:{HOUR}") <= key_usage.KEEP_SECONDS


def test_a_copy_that_fails_to_write_leaves_the_hours_for_the_next_run(redis, monkeypatch):
    client, prefix = redis
    key, _ = a_key()
    counts = UsageCounts()
    counts.hours[(HOUR, key.pk)] = Figures(requests=2)
    write(client, prefix, counts)

    def broken(*args, **kwargs):
        raise RuntimeError("the database went away")

    monkeypatch.setattr(KeyUsage.objects, "bulk_create", broken)
    with pytest.raises(RuntimeError):
        gateway_usage.usage_copy(client=client, prefix=prefix)
    monkeypatch.undo()

    assert gateway_usage.usage_copy(client=client, prefix=prefix) == 1
    assert KeyUsage.objects.get(key=key).requests == 2


def test_usage_is_read_back_by_the_hour_for_the_page_and_the_api():
    key, _ = a_key()
    now = datetime(2027, 3, 4, 12, 30, tzinfo=UTC)
    this_hour = now.replace(minute=0)
    for back, requests in [(0, 5), (2, 7), (23, 1), (24, 100)]:
        KeyUsage.objects.create(key=key, hour=this_hour - timedelta(hours=back), requests=requests, prompt_tokens=10 * requests,
                                completion_tokens=requests, errors=back == 2, refused=3 if back == 0 else 0)

    day = gateway_usage.usage_last_day([key.pk], now=now)[key.pk]
    hours = gateway_usage.usage_hours(key, hours=3, now=now)

    assert (day.requests, day.errors, day.refused, day.tokens) == (13, 1, 3, 143), "the 24 hours up to this one"
    assert day.per_hour[-1] == 5 and day.per_hour[-3] == 7 and day.per_hour[0] == 1 and sum(day.per_hour) == 13
    assert [h["hour"] for h in hours["hours"]] == [this_hour - timedelta(hours=2), this_hour - timedelta(hours=1), this_hour]
    assert [h["requests"] for h in hours["hours"]] == [7, 0, 5] and hours["total"]["requests"] == 12
    assert hours["from"] == this_hour - timedelta(hours=2) and hours["to"] == this_hour + timedelta(hours=1)


def test_old_hours_are_pruned_after_the_days_kept():
    key, _ = a_key()
    now = datetime(2027, 3, 4, 12, tzinfo=UTC)
    KeyUsage.objects.create(key=key, hour=now - timedelta(days=31), requests=1)
    KeyUsage.objects.create(key=key, hour=now - timedelta(days=29), requests=2)

    assert gateway_usage.usage_prune(now - timedelta(days=30)) == 1
    assert list(KeyUsage.objects.values_list("requests", flat=True)) == [2]


def test_the_snapshot_carries_each_keys_limits_to_the_gateway():
    limited, _ = a_key(name="limited", requests_per_minute=5, tokens_per_minute=1000)
    free, _ = a_key(name="free")

    rows = {row[1]: row[4:] for row in snapshot_load().keys}

    assert rows == {limited.pk: (5, 1000), free.pk: (None, None)}


def write(client, prefix: str, counts: UsageCounts) -> None:
    pipe = client.pipeline(transaction=False)
    key_usage.usage_add(pipe, prefix, counts)
    pipe.execute()
