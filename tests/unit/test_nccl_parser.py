"""The nccl-tests all_reduce_perf parser on real outputs from public runs (tests/fixtures/nccl/, each
with its source on its first line), the sweep's sizes and the slow link's projection (clusters/nccl.py)."""
from pathlib import Path

import pytest

from clusters.nccl import (
    GiB,
    MiB,
    NcclOutputError,
    SizeResult,
    duration_words,
    parse_all_reduce,
    projected_seconds,
    should_stop,
    sizes,
    slow_link_sentence,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nccl"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_every_fixture_names_its_public_source_on_its_first_line():
    names = sorted(p.name for p in FIXTURES.glob("*.txt"))
    assert len(names) >= 3
    for name in names:
        assert fixture(name).splitlines()[0].startswith("# Source: https://github.com/")


# (file, rows, first size, last size, peak size, peak busbw, avg line)
RUNS = [
    # nccl-tests 2.18.2: root column, #wrong counts, "Collective test concluded" after the table
    ("cscs-gh200-2.18.2.txt", 8, MiB, 128 * MiB, 128 * MiB, 22.88, 14.9966),
    # 2 x 8 H100: 8 B to 8 GiB, the peak out of place at the last size
    ("a3mega-h100-2x8.txt", 31, 8, 8 * GiB, 8 * GiB, 338.82, 70.742),
    # older: no root, "error" columns holding N/A (validation off), sizes in 1 MiB steps
    ("t4-3nodes-no-validation.txt", 11, 100 * MiB, 110 * MiB, 108003328, 0.74, 0.58536),
]


@pytest.mark.parametrize("name,count,first,last,peak_size,peak_busbw,avg", RUNS)
def test_each_recorded_run_parses_to_its_rows_sizes_and_peak(name, count, first, last, peak_size, peak_busbw, avg):
    run = parse_all_reduce(fixture(name))
    assert len(run.rows) == count
    assert (run.rows[0].size_bytes, run.rows[-1].size_bytes) == (first, last)
    assert (run.peak.size_bytes, run.peak_busbw) == (peak_size, peak_busbw)
    assert run.complete and run.avg_busbw == avg and run.out_of_bounds == 0


def test_a_newer_row_reads_its_columns_by_name_past_redop_and_root():
    row = parse_all_reduce(fixture("cscs-gh200-2.18.2.txt")).rows[2]
    assert row == SizeResult(size_bytes=4194304, time_us=476.28, busbw_out_of_place=8.81, busbw_in_place=8.90,
                             wrong_out_of_place=0, wrong_in_place=0, time_in_place_us=471.14)


def test_an_older_row_without_root_and_with_n_a_has_no_wrong_counts():
    row = parse_all_reduce(fixture("t4-3nodes-no-validation.txt")).rows[3]
    assert row == SizeResult(size_bytes=108003328, time_us=239908.0, busbw_out_of_place=0.60, busbw_in_place=0.74,
                             wrong_out_of_place=None, wrong_in_place=None, time_in_place_us=193760.0)


def test_an_error_magnitude_column_of_old_versions_is_not_taken_for_a_count():
    # The 2019-2020 tables printed the largest error (0e+00, 2e-07) where newer ones count wrong values.
    text = fixture("t4-3nodes-no-validation.txt").replace("    N/A", "  2e-07")
    row = parse_all_reduce(text).rows[0]
    assert (row.wrong_out_of_place, row.wrong_in_place, row.busbw_out_of_place) == (None, None, 0.69)


def test_nccl_info_lines_mpirun_tags_and_indentation_between_rows_are_skipped():
    lines = fixture("a3mega-h100-2x8.txt").splitlines()
    noisy = []
    for line in lines:
        noisy.append("[1,0]<stdout>:" + line if line.strip() and not line.startswith("#") else "    " + line)
        noisy.append("ztan-mig-235z:6899:6950 [0] NCCL INFO comm 0x55ba65abd9d0 rank 0 nranks 16 - Init COMPLETE")
        noisy.append("1 2 3")  # a stray line of numbers that is no row
    run = parse_all_reduce("\n".join(noisy))
    assert run.rows == parse_all_reduce(fixture("a3mega-h100-2x8.txt")).rows


def test_a_header_printed_again_by_each_rank_does_not_start_over():
    text = fixture("cscs-gh200-2.18.2.txt")
    header = "\n".join(line for line in text.splitlines() if line.lstrip("# ").startswith("size"))
    doubled = text.replace("     8388608", header + "\n     8388608", 1)
    assert len(parse_all_reduce(doubled).rows) == 8


def test_a_run_cut_short_gives_the_sizes_that_finished_and_says_it_is_not_complete():
    text = fixture("a3mega-h100-2x8.txt")
    cut = text[: text.index("    33554432")] + "    33554432       8388608     float     sum      -1   105"  # killed mid-line
    run = parse_all_reduce(cut)
    assert not run.complete and run.avg_busbw is None
    assert len(run.rows) == 22 and run.rows[-1].size_bytes == 16 * MiB
    assert run.peak.size_bytes == 16 * MiB


@pytest.mark.parametrize("garbage", [
    "",
    "bash: all_reduce_perf: command not found\n",
    "# nThread 1 nGpus 1 minBytes 8 maxBytes 128\n#\n# Using devices\nTest NCCL failure common.cu:1005 'unhandled system error'\n",
    "\x00\xff binary junk 1 2 3 4 5 6 7 8 9 10 11 12 13\n",
])
def test_output_without_a_table_is_refused_with_a_sentence_saying_what_was_missing(garbage):
    with pytest.raises(NcclOutputError, match="No all_reduce_perf table"):
        parse_all_reduce(garbage)


def test_a_header_with_no_rows_yet_is_an_empty_incomplete_run():
    text = fixture("cscs-gh200-2.18.2.txt")
    run = parse_all_reduce(text[: text.index("     1048576")])
    assert run.rows == () and not run.complete and run.peak is None and run.peak_busbw is None


def test_a_failed_validation_is_reported_by_its_count():
    text = fixture("cscs-gh200-2.18.2.txt").replace("# Out of bounds values : 0 OK", "# Out of bounds values : 4 FAILED")
    text = text.replace("22.86       0  5867.43   22.88   22.88       0", "22.86       3  5867.43   22.88   22.88       1")
    run = parse_all_reduce(text)
    assert run.out_of_bounds == 4
    assert (run.rows[-1].wrong_out_of_place, run.rows[-1].wrong_in_place) == (3, 1)


# ------------------------------------------------------------------ sweeps and projections


def test_sizes_double_from_one_mib_to_one_gib():
    assert sizes() == [MiB * 2**i for i in range(11)]
    assert sizes(MiB, 64 * MiB) == [MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB]
    assert sizes(3, 20) == [3, 6, 12]
    with pytest.raises(ValueError):
        sizes(0, GiB)
    with pytest.raises(ValueError):
        sizes(GiB, MiB)


def test_projection_scales_the_largest_measured_size_to_the_rest():
    # 1 MiB took 1 s out of place and 3 s in place: 2 s a call; 2 and 4 MiB would take 4 s and 8 s a call.
    rows = [SizeResult(MiB // 2, 999.0, 1, 1, time_in_place_us=999.0),
            SizeResult(MiB, 1e6, 1, 1, time_in_place_us=3e6)]
    assert projected_seconds(rows, [2 * MiB, 4 * MiB], warmup=0, iters=1) == pytest.approx(2 * (4 + 8))
    assert projected_seconds(rows, [2 * MiB], warmup=5, iters=20) == pytest.approx(4 * 50)
    assert projected_seconds(rows, []) == 0
    with pytest.raises(ValueError):
        projected_seconds([], [MiB])


def test_projection_from_a_recorded_slow_run():
    run = parse_all_reduce(fixture("t4-3nodes-no-validation.txt"))
    # the last size: 305408 us and 307126 us for 110 MiB; 220 MiB at that rate, once each way
    assert projected_seconds(run.rows, [220 * MiB], warmup=0, iters=1) == pytest.approx(2 * 2 * (305408 + 307126) / 2 / 1e6)


def test_the_test_stops_after_five_sizes_when_the_rest_would_not_fit_in_the_limit():
    fast = [SizeResult(MiB * 2**i, 10.0 * 2**i, 1, 1) for i in range(5)]
    slow = [SizeResult(MiB * 2**i, 1e5 * 2**i, 1, 1) for i in range(5)]
    rest = sizes(32 * MiB, GiB)
    assert should_stop(slow, rest, elapsed_seconds=30)
    assert not should_stop(fast, rest, elapsed_seconds=30)
    assert not should_stop(slow[:4], rest, elapsed_seconds=30)  # not before five sizes
    assert not should_stop(slow, [], elapsed_seconds=30)


def test_the_slow_link_sentence_reads_as_the_issue_says():
    assert slow_link_sentence(5, ("lab-a", "lab-b"), 14 * 60 + 10) == (
        "stopped after 5 sizes: the link between lab-a and lab-b would take about 14 minutes for the rest")
    assert slow_link_sentence(1, ("a", "b"), 30).startswith("stopped after 1 size: ")


@pytest.mark.parametrize("seconds,words", [
    (0.2, "about 1 second"), (45, "about 45 seconds"), (89, "about 89 seconds"), (90, "about 2 minutes"),
    (61 * 60, "about 61 minutes"), (3 * 3600, "about 3 hours"), (5400, "about 2 hours"),
])
def test_durations_in_words(seconds, words):
    assert duration_words(seconds) == words
