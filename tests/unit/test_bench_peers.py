"""bench/peers.py's pure parts: /proc's numbers, pip's reason, the .pth guard, LiteLLM's config, the table and
the goals. Nothing here installs or starts a peer."""
import json

from bench.peers import descendants, goals, litellm_config, pip_reason, proc_stat, startup_hooks, table


def test_proc_stat_reads_the_parent_and_the_ticks_of_a_name_with_spaces_and_parentheses():
    line = "4242 (vllm::router (x) y) S 4000 4242 4242 0 -1 4194560 100 0 0 0 150 25 7 3 20 0 3 0 900 0 0"
    assert proc_stat(line) == (4000, 150 + 25 + 7 + 3)


def test_descendants_take_children_and_grandchildren_not_the_neighbours():
    parents = {10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 21: 20}
    assert descendants(parents, 10) == {10, 11, 12, 13}
    assert descendants(parents, 21) == {21}


def test_pip_reason_is_its_error_lines_else_its_last_line():
    output = ("Collecting litellm[proxy]==1.110.2\nERROR: Could not find a version that satisfies the requirement "
              "litellm-proxy==1.110.2\nERROR: No matching distribution found for litellm-proxy==1.110.2\n")
    assert pip_reason(output) == ("ERROR: Could not find a version that satisfies the requirement litellm-proxy==1.110.2 "
                                  "ERROR: No matching distribution found for litellm-proxy==1.110.2")
    assert pip_reason("one\nkilled\n") == "killed"


def test_a_pth_file_that_imports_code_is_found_and_the_usual_ones_are_not(tmp_path):
    (tmp_path / "litellm_init.pth").write_text("import os, subprocess; subprocess.Popen(['python', '-c', '...'])\n")
    (tmp_path / "distutils-precedence.pth").write_text("import os; var = 'SETUPTOOLS_USE_DISTUTILS'\n")
    (tmp_path / "paths.pth").write_text("/opt/somewhere\n")
    assert startup_hooks(tmp_path) == ["litellm_init.pth"]


def test_litellm_config_points_at_the_engine_with_a_master_key_and_no_database():
    config = json.loads(litellm_config("bench", "http://127.0.0.1:8100", "sk-x"))
    assert config["model_list"] == [{"model_name": "bench", "litellm_params": {
        "model": "openai/bench", "api_base": "http://127.0.0.1:8100/v1", "api_key": "none"}}]
    assert config["general_settings"] == {"master_key": "sk-x"}


def figures_of(added_p50: float, rps64: float, cpu_us: float | None = 100.0) -> dict:
    return {"p50_ms": 0.1 + added_p50, "p99_ms": 0.5, "added_p50_ms": added_p50, "added_p99_ms": 0.3,
            "first_p50_ms": 0.2, "first_p99_ms": 0.6, "failed": 0, "requests": 1000, "reopened": 0,
            "rps": {"whole-16": rps64, "stream-16": rps64, "whole-64": rps64, "stream-64": rps64},
            "cpu_us": {} if cpu_us is None else {"whole-64": cpu_us, "stream-64": cpu_us},
            "cores": {} if cpu_us is None else {"whole-64": 0.5, "stream-64": 0.5}}


def test_the_table_puts_the_paths_side_by_side_and_says_which_did_not_run():
    found = {"direct": figures_of(0.0, 9000, None), "gateway": figures_of(0.12, 7000)}
    text = table(found, ["direct", "gateway", "litellm"], {"litellm": "could not be installed"})
    assert text.splitlines()[0] == "| | direct | gateway | litellm |"
    row = next(line for line in text.splitlines() if line.startswith("| requests/s, 64 concurrent, whole"))
    assert row == "| requests/s, 64 concurrent, whole | 9,000 | 7,000 | not run |"
    assert "| router CPU per request, 64 conc., whole (us) | - | 100 | not run |" in text


def test_goals_say_met_or_not_met_against_each_peer_and_name_a_peer_that_did_not_run():
    found = {"direct": figures_of(0.0, 9000, None), "gateway": figures_of(0.12, 7000),
             "vllm-router": figures_of(0.10, 6000)}
    lines = goals(found, ["gateway"], {"litellm": "could not be installed: ERROR: ..."})
    assert "gateway against vllm-router, added p50: NOT MET (+0.12 against +0.10 ms)" in lines
    assert "gateway against vllm-router, requests/s at 64, whole: met (7,000 against 6,000)" in lines
    assert lines[-1] == "gateway ahead of litellm: not judged, litellm did not run (could not be installed: ERROR: ...)"
    found["litellm"] = figures_of(3.0, 7500, cpu_us=5000)
    assert goals(found, ["gateway"], {})[-1] == ("gateway ahead of litellm on every figure: NOT MET (behind on "
                                                "requests/s whole-16, requests/s stream-16, requests/s whole-64, "
                                                "requests/s stream-64)")
