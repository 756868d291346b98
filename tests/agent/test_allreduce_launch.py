"""The NCCL test's launches (``allreducelaunch``): the runtime's launcher holds no key and asks the head's
agent over the run's abstract socket; the agent checks who asks (``SO_PEERCRED``), launches each node of the
run once with one line of text, and runs ssh itself. And the agent's private directory for the run: never a
link, never in the store, its files replacing links and never read through them."""

import os
import subprocess
import sys
import time

import pytest

from fadenstack_agent import allreducelaunch, allreducespec, proctree
from fadenstack_agent.protocol import AgentError


def wait_for(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def launches(tmp_path, hosts, allowed=lambda pid: True):
    """The run's socket, its ssh a recorder of its words (each launch's in a file of the host's name)."""
    recorder = tmp_path / "ssh"
    recorder.write_text('#!/bin/sh\necho "daemon out"\necho "daemon err" >&2\n'
                        'for w in "$@"; do printf "%%s\\0" "$w"; done > "%s/$8"\nexit 7\n' % tmp_path)
    recorder.chmod(0o755)
    remote = allreducespec.remote_agent_argv("gpu-room", "/opt/fadenstack/agent/fadenstack agent 0.8.0.pyz", None)
    name = allreducelaunch.socket_name()
    server = allreducelaunch.LaunchServer(
        name, hosts, lambda host, command: [str(recorder)] + allreducespec.ssh_argv("/opt/x/ssh_config", host, remote, command)[1:],
        allowed)
    launcher = tmp_path / "launch"
    launcher.write_text(allreducespec.launcher_text(name))
    return server, launcher, remote


def test_the_agent_hands_the_remote_shell_orteds_words_exactly_as_mpirun_gave_the_launcher(tmp_path):
    server, launcher, remote = launches(tmp_path, ["198.18.1.12"])
    words = ["orted", "-mca", "ess", '"env"', "-mca", "orte_hnp_uri", '"88932352.0;tcp://10.0.0.1:53745"', "it's", "$(id)"]
    try:
        done = subprocess.run([sys.executable, str(launcher), "198.18.1.12", *words], capture_output=True, timeout=30)
        assert (done.returncode, done.stdout, done.stderr) == (7, b"daemon out\n", b"daemon err\n")  # the daemon's, through
        again = subprocess.run([sys.executable, str(launcher), "198.18.1.12", "orted"], capture_output=True, timeout=30)
    finally:
        server.close()
    argv = (tmp_path / "198.18.1.12").read_bytes().split(b"\0")[:-1]
    assert [w.decode() for w in argv[:7]] == ["-F", "/opt/x/ssh_config", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "--"]
    assert argv[7] == b"198.18.1.12" and len(argv) == 9  # the remote command line: one word
    as_remote_shell = "set -- " + argv[8].decode() + "; for w in \"$@\"; do printf '%s\\0' \"$w\"; done"
    parsed = subprocess.run(["sh", "-c", as_remote_shell], capture_output=True, check=True).stdout.split(b"\0")[:-1]
    assert [w.decode() for w in parsed] == remote + [" ".join(words)]
    assert again.returncode == 255 and b"is not a node of this run left to launch" in again.stderr  # each node once


def test_launches_are_refused_to_a_caller_outside_the_run_and_to_an_address_not_of_its_nodes(tmp_path):
    server, launcher, _ = launches(tmp_path, ["198.18.1.12"], allowed=lambda pid: False)
    try:
        outside = subprocess.run([sys.executable, str(launcher), "198.18.1.12", "orted"], capture_output=True, timeout=30)
    finally:
        server.close()
    assert outside.returncode == 255 and outside.stderr == b"allreduce launcher: not the run's runtime\n"
    server, launcher, _ = launches(tmp_path, ["198.18.1.12"])
    try:
        head = subprocess.run([sys.executable, str(launcher), "198.18.1.11", "orted"], capture_output=True, timeout=30)
        newline = subprocess.run([sys.executable, str(launcher), "198.18.1.12", "orted\nreboot"], capture_output=True, timeout=30)
    finally:
        server.close()
    assert head.returncode == 255 and b'"198.18.1.11" is not a node of this run left to launch' in head.stderr
    assert newline.returncode == 255 and b"must be one line of text" in newline.stderr
    assert not list(tmp_path.glob("198.*"))  # no ssh ran


def test_a_caller_is_the_runs_when_it_descends_from_mpirun_or_lives_in_the_containers_pid_namespace():
    child = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        assert wait_for(lambda: len(proctree.snapshot(child.pid)) == 2)
        grandchild = max(proctree.snapshot(child.pid))
        assert allreducelaunch.descendant_of(child.pid)(grandchild) and allreducelaunch.descendant_of(child.pid)(child.pid)
        assert not allreducelaunch.descendant_of(child.pid)(os.getpid())
        assert not allreducelaunch.in_namespace_of(child.pid)(grandchild)  # our own namespace is no container's
    finally:
        child.kill()
        child.wait()


def test_the_runs_private_directory_is_refused_as_a_link_or_inside_the_store_and_its_files_replace_links(tmp_path, monkeypatch):
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("FADEN_AGENT_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    os.symlink(elsewhere, tmp_path / "home" / "allreduce")  # a link where the directory goes
    with pytest.raises(AgentError, match="must be a directory of the agent's own, outside the store"):
        allreducelaunch.private_dir(str(store))
    monkeypatch.setenv("FADEN_AGENT_HOME", str(store / "home"))  # a home the runtime would see
    with pytest.raises(AgentError, match="outside the store"):
        allreducelaunch.private_dir(str(store))
    monkeypatch.setenv("FADEN_AGENT_HOME", str(tmp_path / "own"))
    private = allreducelaunch.private_dir(str(store))
    assert os.stat(private).st_mode & 0o777 == 0o700
    target = elsewhere / "authorized_keys"
    target.write_text("root's own\n")
    os.symlink(target, os.path.join(private, "ssh_config"))
    allreducelaunch.write_private(os.path.join(private, "ssh_config"), b"Host *\n")
    assert target.read_text() == "root's own\n" and not os.path.islink(os.path.join(private, "ssh_config"))
    os.symlink(target, os.path.join(private, "mpirun.pid"))
    assert allreducelaunch.read_private(os.path.join(private, "mpirun.pid")) is None  # not followed
