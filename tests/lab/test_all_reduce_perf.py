"""The lab's ``all_reduce_perf`` (``lab/stubs/all_reduce_perf``), without a lab: node processes on
loopback addresses (127.0.0.2, 127.0.0.3, ... are this host's on Linux), their output read by the
console's own parser (``clusters.nccl``). No root, no namespaces: the ring runs with /usr/bin/python3,
the interpreter of the runtime image and the lab host."""

import importlib.machinery
import importlib.util
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from clusters.nccl import MiB, parse_all_reduce, sizes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUB = os.path.join(REPO, "lab", "stubs", "all_reduce_perf")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
ROW = re.compile(rb"^\s+\d+\s+\d+\s+float\s", re.M)
QUICK = ["-n", "2", "-w", "0"]  # a short sweep: one untimed all-reduce, two timed, one check per half-row


def free_port(address="127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def command(*args, python=PYTHON):
    return [python, STUB, *args]


@contextmanager
def nodes(count, *args, where=None):
    """``count`` node processes of one run, each with its rank; killed if a test leaves them running."""
    where = where or ["--nodes", ",".join("127.0.0.%d:%d" % (2 + k, free_port("127.0.0.%d" % (2 + k)))
                                          for k in range(count))]
    started = [subprocess.Popen(command(*where, "--rank", str(rank), *args), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE) for rank in range(count)]
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()
            process.stderr.close()


def finish(processes, timeout=60):
    return [(p.returncode, out.decode(), err.decode()) for p in processes
            for out, err in [p.communicate(timeout=timeout)]]


def stub_module():
    """The script as a module, for its pure parts (the ring's plan)."""
    loader = importlib.machinery.SourceFileLoader("all_reduce_perf", STUB)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


# ------------------------------------------------------------------ the ring's output, parsed


def test_two_nodes_sum_a_doubling_sweep_that_the_console_parser_reads():
    with nodes(2, "-b", "512K", "-e", "4M", "-f", "2", *QUICK) as processes:
        (rc0, out0, err0), (rc1, out1, err1) = finish(processes)
    assert (rc0, err0, rc1, out1, err1) == (0, "", 0, "", "")  # rank 0 prints the table, the other nothing
    assert out0.startswith("# nThread 1 nGpus 1 minBytes 524288 maxBytes 4194304 step: 2(factor) warmup iters: 0 "
                           "iters: 2 agg iters: 1 validation: 1 graph: 0\n")
    assert len(re.findall(r"^#  Rank  [01] Group  0 Pid +\d+ on +\S+ device  0 \[0x18\] ", out0, re.M)) == 2
    run = parse_all_reduce(out0)
    assert run.complete and run.out_of_bounds == 0
    assert [row.size_bytes for row in run.rows] == sizes(512 * 1024, 4 * MiB)
    for row in run.rows:
        assert (row.wrong_out_of_place, row.wrong_in_place) == (0, 0)
        assert row.time_us > 0 and row.time_in_place_us > 0
        assert row.busbw_out_of_place > 0 and row.busbw_in_place > 0
    assert run.avg_busbw > 0


def test_three_nodes_from_a_hostfile_count_every_slot_as_a_rank_and_the_bus_bandwidth_follows(tmp_path):
    port = free_port("127.0.0.2")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# fadenstack cluster\n127.0.0.2 slots=2\n127.0.0.3 slots=2\n\n127.0.0.4 slots=2\n")
    where = ["--hostfile", str(hostfile), "--port", str(port)]
    with nodes(3, "-b", "1M", "-e", "2M", "-f", "2", "-n", "1", "-w", "0", where=where) as processes:
        results = finish(processes)
    assert [rc for rc, _, _ in results] == [0, 0, 0], results
    out = results[0][1]
    ranks = re.findall(r"^#  Rank +(\d+) Group  0 Pid +\d+ on +\S+ device +(\d) ", out, re.M)
    assert ranks == [(str(r), str(r % 2)) for r in range(6)]  # 3 nodes x 2 GPUs, each node's numbered from 0
    run = parse_all_reduce(out)
    assert [row.size_bytes for row in run.rows] == [MiB, 2 * MiB]
    for row in run.rows:
        assert (row.wrong_out_of_place, row.wrong_in_place) == (0, 0)
        algbw = row.size_bytes / row.time_us / 1e3
        assert row.busbw_out_of_place == pytest.approx(algbw * 2 * 5 / 6, abs=0.006)  # n = 6 ranks


def test_a_run_cut_short_parses_to_the_sizes_that_finished_and_its_port_is_already_closed():
    port = free_port("127.0.0.2")
    where = ["--nodes", "127.0.0.2:%d,127.0.0.3:%d" % (port, port)]
    with nodes(2, "-b", "256K", "-e", "1G", "-f", "2", "-n", "1", "-w", "0", where=where) as (lead, other):
        printed, deadline = b"", time.monotonic() + 30
        while len(ROW.findall(printed)) < 2 and time.monotonic() < deadline:
            if select.select([lead.stdout], [], [], 1.0)[0]:
                chunk = os.read(lead.stdout.fileno(), 65536)
                assert chunk, lead.stderr.read().decode()
                printed += chunk
        with pytest.raises(ConnectionRefusedError):  # the ring stands: nothing listens any more
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
        other.send_signal(signal.SIGKILL)
        out, err = lead.communicate(timeout=30)
    run = parse_all_reduce((printed + out).decode())
    assert not run.complete and run.avg_busbw is None
    assert len(run.rows) >= 2
    assert [row.size_bytes for row in run.rows] == sizes(256 * 1024, 1024 * MiB)[:len(run.rows)]
    assert lead.returncode == 1
    assert "node 1 at 127.0.0.3:%d" % port in err.decode()


# ------------------------------------------------------------------ errors in plain words


def test_a_node_whose_peer_never_starts_names_it_and_gives_up_at_its_timeout():
    port = free_port("127.0.0.2")
    started = time.monotonic()
    result = subprocess.run(command("--nodes", "127.0.0.2:%d,127.0.0.3:%d" % (port, port), "--rank", "0",
                                    "--connect-timeout", "1", "-b", "1M", "-e", "1M"),
                            capture_output=True, text=True, timeout=30)
    assert time.monotonic() - started < 15  # 1 s, and the interpreter's start on a busy host
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == ("all_reduce_perf (node 0 at 127.0.0.2:%d): error: node 1 at 127.0.0.3:%d did not answer "
                             "within 1 s (connection refused): is it started, with the same node list?\n" % (port, port))
    with socket.socket() as again:  # nothing was left listening
        again.bind(("127.0.0.2", port))


def test_a_taken_port_and_an_address_not_of_this_machine_are_said_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        busy = subprocess.run(command("--nodes", "127.0.0.2:%d,127.0.0.3:%d" % (port, port), "--rank", "0"),
                              capture_output=True, text=True, timeout=30)
    assert busy.returncode == 1
    assert "error: port %d on 127.0.0.2 is taken" % port in busy.stderr
    elsewhere = subprocess.run(command("--nodes", "192.0.2.1,127.0.0.3", "--rank", "0"),
                               capture_output=True, text=True, timeout=30)
    assert elsewhere.returncode == 1
    assert "error: 192.0.2.1 is not an address of this machine: is --rank 0 this node's place in the list?" \
        in elsewhere.stderr


def test_a_node_started_with_other_arguments_is_refused_by_its_neighbour():
    port = free_port("127.0.0.2")
    where = ["--nodes", "127.0.0.2:%d,127.0.0.3:%d" % (port, port), "--connect-timeout", "20"]
    zero = subprocess.Popen(command(*where, "--rank", "0", "-b", "1M", "-e", "1M", "-n", "3"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    one = subprocess.Popen(command(*where, "--rank", "1", "-b", "1M", "-e", "1M", "-n", "5"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (_, err0), (_, err1) = zero.communicate(timeout=30), one.communicate(timeout=30)
    assert (zero.returncode, one.returncode) == (1, 1)
    assert ("node 1 at 127.0.0.3:%d was started with other arguments: -n 5 there, 3 here" % port in err0
            or "node 0 at 127.0.0.2:%d was started with other arguments: -n 3 there, 5 here" % port in err1), (err0, err1)


@pytest.mark.parametrize("flags, words", [
    (["--bogus"], "all_reduce_perf: error: unrecognized arguments: --bogus"),
    (["-o", "max"], "argument -o/--op: invalid choice: 'max'"),
    (["-b", "8M", "-e", "1M"], "invalid sizes for 'minbytes' and 'maxbytes': 8388608 > 1048576"),
    (["-b", "lots"], "argument -b/--minbytes: invalid size 'lots'"),
])
def test_bad_flags_are_refused_as_argparse_refuses_them_with_exit_status_2(flags, words):
    result = subprocess.run(command("--nodes", "127.0.0.2,127.0.0.3", "--rank", "0", *flags, python=sys.executable),
                            capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (2, "")
    assert words in result.stderr


# ------------------------------------------------------------------ the bytes on the wire


@pytest.mark.parametrize("gpus", [(1, 1), (1, 1, 1), (8, 8), (2, 2, 2), (3, 1, 4)])
def test_each_link_between_nodes_carries_what_the_ring_of_all_ranks_carries_on_that_hop(gpus):
    module = stub_module()
    nranks = sum(gpus)
    chunk = 3 * module.SLICE_BYTES // 2  # chunks of one and a half slices
    count = nranks * chunk // module.WORD
    for node, own in enumerate(gpus):
        plan = module.Plan(count, nranks, sum(gpus[:node]), own)
        assert sum(b - a for a, b, *_ in plan.outgoing) == 2 * (nranks - 1) * chunk
        assert sum(b - a for a, b, *_ in plan.incoming) == 2 * (nranks - 1) * chunk
        # the node adds its data to every chunk that did not begin on it: the other nodes' ranks' chunks
        assert sum(b - a for a, b, add in plan.incoming if add) == (nranks - own) * chunk


# ------------------------------------------------------------------ under mpirun: nccl-tests' own flags only


def mpirun_env(rank, size, hostfile, port, **more):
    """What Open MPI's mpirun gives each of its processes (the rank and the size), and the lab's hostfile and port."""
    env = {k: v for k, v in os.environ.items() if k != "FADEN_ALLREDUCE_NODES"}
    return dict(env, OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(size),
                FADEN_LAB_HOSTFILE=str(hostfile), FADEN_LAB_ALL_REDUCE_PORT=str(port), **more)


def test_started_as_mpirun_starts_it_the_rank_comes_from_open_mpi_and_the_nodes_from_the_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=8\n127.0.0.3 slots=8\n")  # the cluster's: slots are GPUs, one process a node
    port = free_port("127.0.0.2")
    flags = ["-b", "1M", "-e", "2M", "-f", "2", "-g", "2", "-n", "1", "-w", "0", "-c", "1"]  # as nccl-tests takes them
    started = [subprocess.Popen(command(*flags), env=mpirun_env(rank, 2, hostfile, port), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE) for rank in range(2)]
    try:
        (rc0, out0, err0), (rc1, out1, err1) = finish(started)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
    assert (rc0, err0, rc1, out1, err1) == (0, "", 0, "", "")
    ranks = re.findall(r"^#  Rank +(\d+) Group  0 Pid +\d+ on +\S+ device +(\d) ", out0, re.M)
    assert ranks == [("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")]  # 2 nodes x -g 2, whatever the slots say
    run = parse_all_reduce(out0)
    assert run.complete and [row.size_bytes for row in run.rows] == [MiB, 2 * MiB]
    assert all((row.wrong_out_of_place, row.wrong_in_place) == (0, 0) for row in run.rows)


def test_under_mpirun_the_agents_node_list_comes_before_the_hostfile(tmp_path):
    port = free_port("127.0.0.2")
    missing = tmp_path / "no-hostfile"  # never read: FADEN_ALLREDUCE_NODES names the nodes
    started = [subprocess.Popen(command("-b", "1M", "-e", "1M", "-n", "1", "-w", "0"),
                                env=mpirun_env(rank, 2, missing, port, FADEN_ALLREDUCE_NODES="127.0.0.2,127.0.0.3"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]
    try:
        (rc0, out0, err0), (rc1, _, err1) = finish(started)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
    assert (rc0, err0, rc1, err1) == (0, "", 0, "")
    assert parse_all_reduce(out0).complete


def test_one_process_per_gpu_runs_nodes_of_different_gpu_counts_as_one_ring_of_all_their_gpus(tmp_path):
    """The console's way (-np <all GPUs> -g 1, a slot per GPU): 2 GPUs on one node, 1 on the other; each
    node's first process carries its node's GPUs, the other leaves at once, and the table counts all 3."""
    port = free_port("127.0.0.2")
    flags = ["-b", "1M", "-e", "2M", "-f", "2", "-g", "1", "-n", "1", "-w", "0", "-c", "1"]
    started = [subprocess.Popen(command(*flags), env=mpirun_env(rank, 3, tmp_path / "no-hostfile", port,
                                                                FADEN_ALLREDUCE_NODES="127.0.0.2,127.0.0.3",
                                                                FADEN_ALLREDUCE_SLOTS="2,1"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(3)]
    try:
        (rc0, out0, err0), (rc1, out1, err1), (rc2, out2, err2) = finish(started)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
    assert (rc0, err0, rc1, out1, err1, rc2, out2, err2) == (0, "", 0, "", "", 0, "", "")
    ranks = re.findall(r"^#  Rank +(\d+) Group  0 Pid +\d+ on +\S+ device +(\d) ", out0, re.M)
    assert ranks == [("0", "0"), ("1", "1"), ("2", "0")]
    run = parse_all_reduce(out0)
    assert run.complete and [row.size_bytes for row in run.rows] == [MiB, 2 * MiB]
    assert all((row.wrong_out_of_place, row.wrong_in_place) == (0, 0) for row in run.rows)


def test_under_mpirun_the_hostfile_s_slots_are_processes_when_mpirun_started_one_per_slot(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=1\n127.0.0.3 slots=2\n")
    port = free_port("127.0.0.2")
    started = [subprocess.Popen(command("-b", "1M", "-e", "1M", "-n", "1", "-w", "0"), env=mpirun_env(rank, 3, hostfile, port),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(3)]
    try:
        (rc0, out0, err0), *others = finish(started)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
    assert (rc0, err0) == (0, "") and [rc for rc, _, _ in others] == [0, 0]
    assert re.search(r"^#  Rank +2 Group  0 Pid +\d+ on +\S+ device +1 ", out0, re.M)


def test_under_mpirun_a_process_count_that_fits_neither_nodes_nor_slots_is_said_so(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.3 slots=2\n")
    result = subprocess.run(command("-b", "1M", "-e", "1M"), env=mpirun_env(0, 3, hostfile, free_port("127.0.0.2")),
                            capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == ("all_reduce_perf (node 0): error: mpirun started 3 processes, but the hostfile %s names 2 "
                             "nodes with 4 slots: run one process per slot (-np 4, -g 1) or one per node (--map-by "
                             "ppr:1:node, -np 2)\n" % hostfile)


def test_without_mpirun_a_node_list_and_a_rank_are_still_required():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    missing = subprocess.run(command("-b", "1M"), env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2
    assert "one of the arguments --nodes --hostfile is required (or start it under mpirun)" in missing.stderr
    no_rank = subprocess.run(command("--nodes", "127.0.0.2,127.0.0.3"), env=env, capture_output=True, text=True, timeout=30)
    assert no_rank.returncode == 2 and "the following arguments are required: --rank" in no_rank.stderr
