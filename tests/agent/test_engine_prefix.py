"""The lab's engine (lab/stubs/vllm) models vLLM's prefix cache: a prompt's prefill costs time per token, the
leading blocks it has seen lately are not prefilled again, within the cache's size, and /metrics counts the
tokens queried and hit under vLLM's names (parsed with prometheus_client's own parser)."""
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.agent.test_copies import Running, tiny_model  # noqa: F401 (a fixture)

SYSTEM = " ".join(f"rule{n}" for n in range(800))  # 800 tokens of words


def chat(*turns: str, system: str = SYSTEM) -> dict:
    return {"messages": [{"role": "system", "content": system}] + [{"role": "user", "content": t} for t in turns],
            "max_tokens": 2}


def first_token(engine: Running, body: dict) -> float:
    """Seconds from the request to its first token, streamed."""
    return next(at for at, event in engine.stream("/v1/chat/completions", body) if isinstance(event, dict)
                and event["choices"] and event["choices"][0]["delta"].get("content"))


def counters(engine: Running) -> dict:
    """The engine's counters as prometheus_client reads them: {(family, sample): value}."""
    status, text = engine.request("GET", "/metrics")
    assert status == 200
    return {(family.name, sample.name): sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if family.type == "counter"}


def test_prefill_costs_time_per_token_and_a_prefix_seen_lately_is_not_prefilled_again(tiny_model, tmp_path):
    engine = Running(tmp_path, tiny_model, "--max-model-len", "2048",
                     env={"FADEN_LAB_ENGINE_PREFILL": "4000", "FADEN_LAB_ENGINE_PREFIX_CACHE": "5000"}).wait_listening()
    try:
        cold = first_token(engine, chat("Where does the river go?"))
        warm = first_token(engine, chat("Where does the river go?", "And then?"))  # the same 800 tokens and more
        assert cold >= 0.2, "about 810 tokens at 4,000 a second"
        assert warm < cold / 2, (cold, warm)
        found = counters(engine)
        queried = found[("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")]
        hits = found[("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")]
        assert hits >= 800 - 16 and queried > 2 * 800 and hits < queried / 2
        assert found[("vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_hits_total")] == hits
        assert found[("vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_queries_total")] == queried
        assert "Prefix caching on, 5000 tokens in blocks of 16; prefill 4000 prompt tokens/s" in engine.output()

        # Other prompts past the cache's 5,000 tokens evict the first (the least recently used go first).
        for n in range(7):
            engine.request("POST", "/v1/chat/completions", chat("Hello", system=" ".join(f"other{n}x{i}" for i in range(800))))
        before = counters(engine)[("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")]
        again = first_token(engine, chat("Where does the river go?"))
        assert counters(engine)[("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")] == before, "evicted"
        assert again >= 0.2
    finally:
        engine.stop()


def test_without_prefix_caching_every_prompt_is_prefilled_whole_and_nothing_is_hit(tiny_model, tmp_path):
    engine = Running(tmp_path, tiny_model, "--no-enable-prefix-caching").wait_listening()
    try:
        for _ in range(2):
            status, answer = engine.request("POST", "/v1/chat/completions", chat("Where does the river go?"))
            assert status == 200 and answer["usage"]["prompt_tokens"] > 800
        found = counters(engine)
        assert found[("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")] == 0
        assert found[("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")] == 2 * answer["usage"]["prompt_tokens"]
        assert "Prefix caching off" in engine.output()
    finally:
        engine.stop()


def test_the_default_engine_takes_no_time_to_prefill_but_counts_its_cache(tiny_model, tmp_path):
    engine = Running(tmp_path, tiny_model).wait_listening()
    try:
        started = time.monotonic()
        for n in range(3):
            assert engine.request("POST", "/v1/completions", {"prompt": SYSTEM + f" question {n}", "max_tokens": 1})[0] == 200
        assert time.monotonic() - started < 2
        found = counters(engine)
        assert found[("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")] == 2 * (800 // 16) * 16
    finally:
        engine.stop()


def test_a_prefill_pace_or_a_cache_size_that_is_not_a_number_stops_the_start(tiny_model, tmp_path):
    for name, value, words in (("FADEN_LAB_ENGINE_PREFILL", "fast", "FADEN_LAB_ENGINE_PREFILL must be prompt tokens per second"),
                               ("FADEN_LAB_ENGINE_PREFIX_CACHE", "-1", "FADEN_LAB_ENGINE_PREFIX_CACHE must be a whole number")):
        code, output = Running(tmp_path, tiny_model, env={name: value}).ended()
        assert code == 1 and words in output and "Application startup complete." not in output


def gauges(engine: Running) -> dict:
    status, text = engine.request("GET", "/metrics")
    assert status == 200
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if family.type == "gauge"}


def test_a_running_request_holds_its_prompts_and_completions_tokens_in_the_kv_cache_until_it_ends(tiny_model, tmp_path):
    """vLLM's kv_cache_usage_perc (and 0.9's gpu_cache_usage_perc): the share of the cache the running requests hold,
    the cache as large as FADEN_LAB_ENGINE_PREFIX_CACHE; the engine's stats line says the same."""
    engine = Running(tmp_path, tiny_model, "--max-model-len", "2048",
                     env={"FADEN_LAB_ENGINE_PREFIX_CACHE": "5000", "FADEN_LAB_ENGINE_PACE": "20"}).wait_listening()
    try:
        assert gauges(engine)["vllm:kv_cache_usage_perc"] == 0.0
        body = dict(chat("Where does the river go?"), max_tokens=20, ignore_eos=True,
                    stream_options={"include_usage": True})
        running = threading.Thread(target=lambda: answers.append(engine.stream("/v1/chat/completions", body)))
        answers: list = []
        running.start()
        held = wait_for_gauge(engine, lambda g: g["vllm:num_requests_running"] == 1)
        running.join(10)
        usage = next(event["usage"] for _, event in answers[0] if isinstance(event, dict) and event.get("usage"))
        assert held["vllm:kv_cache_usage_perc"] == (usage["prompt_tokens"] + usage["completion_tokens"]) / 5000
        assert held["vllm:gpu_cache_usage_perc"] == held["vllm:kv_cache_usage_perc"]
        assert gauges(engine)["vllm:kv_cache_usage_perc"] == 0.0, "freed when the request ended"
    finally:
        engine.stop()


def wait_for_gauge(engine: Running, ready, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = gauges(engine)
        if ready(found):
            return found
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {found}")
