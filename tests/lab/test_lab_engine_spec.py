"""The lab spec's [engine] prefill pace and prefix cache size reach every machine's agent config (unit tests: no
lab runs)."""
import pytest

from lab import machine as lab_machine
from lab import spec as lab_spec
from lab.util import LabError
from tests.lab.test_lab import minimal_spec


def test_the_prefill_pace_and_the_prefix_cache_reach_the_engines_only_when_the_spec_sets_them():
    plain = lab_spec.parse_spec(minimal_spec(engine={"tokens_per_second": 300}))
    assert plain.engine.environment() == {"FADEN_LAB_ENGINE_PACE": "300"}, "the engine's defaults: no prefill time"
    both = lab_spec.parse_spec(minimal_spec(engine={"prefill_tokens_per_second": 20000, "prefix_cache_tokens": 65536}))
    assert both.engine.environment() == {"FADEN_LAB_ENGINE_PACE": "200", "FADEN_LAB_ENGINE_PREFILL": "20000",
                                         "FADEN_LAB_ENGINE_PREFIX_CACHE": "65536"}
    config = lab_machine.agent_config("m-one", "podman", both)
    assert config["engine_env"]["FADEN_LAB_ENGINE_PREFILL"] == "20000"


@pytest.mark.parametrize("engine, words", [
    ({"prefill_tokens_per_second": -1}, "prefill_tokens_per_second must be a number of prompt tokens per second"),
    ({"prefill_tokens_per_second": "fast"}, "prefill_tokens_per_second must be"),
    ({"prefix_cache_tokens": 1.5}, "prefix_cache_tokens must be a whole number of tokens"),
    ({"prefix_cache_tokens": True}, "prefix_cache_tokens must be a whole number of tokens"),
])
def test_a_prefill_pace_or_cache_size_that_is_not_one_is_refused_in_words(engine, words):
    with pytest.raises(LabError, match=words):
        lab_spec.parse_spec(minimal_spec(engine=engine))
