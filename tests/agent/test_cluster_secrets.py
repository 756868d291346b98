"""``cluster secrets write|remove``: the cluster's secrets directory, written safely from stdin."""

import json
import os
import stat
import subprocess
import sys

import pytest

from fadenstack_agent import clustersecrets, rayproc, secretsdir
from fadenstack_agent.protocol import AgentError

TOKEN = "t0ken-" + "a" * 40


def run(args, stdin: bytes, root: str):
    env = dict(os.environ, FADEN_AGENT_SECRETS=root, PYTHONPATH=clustersecrets.__file__.rsplit("/", 2)[0])
    proc = subprocess.run([sys.executable, "-m", "fadenstack_agent"] + args, input=stdin, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
    events = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    return proc.returncode, events


@pytest.fixture
def root(tmp_path, monkeypatch):
    path = str(tmp_path / "etc" / "clusters")
    monkeypatch.setenv("FADEN_AGENT_SECRETS", path)
    return path


def test_write_makes_a_0700_directory_and_a_0600_token_file_from_stdin(root):
    code, events = run(["cluster", "secrets", "write", "--cluster", "alpha"],
                       json.dumps({"ray_token": TOKEN}).encode(), root)
    assert code == 0, events
    assert events[-1]["files"] == ["ray-token"] and events[-1]["dir"] == os.path.join(root, "alpha")
    assert TOKEN not in json.dumps(events)
    token = os.path.join(root, "alpha", "ray-token")
    assert open(token).read() == TOKEN
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(root, "alpha")).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert secretsdir.ray_token_path("alpha") == token
    # Again, with another token: replaced in place, no temporary file left.
    code, _ = run(["cluster", "secrets", "write", "--cluster", "alpha"],
                  json.dumps({"ray_token": TOKEN[::-1].strip("-") + "x" * 3}).encode(), root)
    assert code == 0 and sorted(os.listdir(os.path.join(root, "alpha"))) == ["ray-token"]


@pytest.mark.parametrize("stdin, words", [
    (b"not json", "JSON object"),
    (b"[]", "JSON object"),
    (b"{}", "JSON object"),
    (json.dumps({"ray_token": "short"}).encode(), "not a token"),
    (json.dumps({"ray_token": "a" * 30 + " ; rm -rf /"}).encode(), "not a token"),
    (json.dumps({"ray_token": 123456789012345678}).encode(), "not a token"),
    (json.dumps({"ray_token": TOKEN, "other": "x"}).encode(), "unknown secret"),
])
def test_bad_input_is_refused_without_repeating_the_value(root, stdin, words):
    code, events = run(["cluster", "secrets", "write", "--cluster", "alpha"], stdin, root)
    assert code == 2 and events[-1]["kind"] == "bad_input" and words in events[-1]["message"]
    assert "rm -rf" not in events[-1]["message"]
    assert not os.path.exists(os.path.join(root, "alpha", "ray-token"))


@pytest.mark.parametrize("cluster", ["Alpha", "-a", "a/../b", "..", "a" * 64])
def test_a_bad_cluster_name_is_refused(root, cluster):
    code, events = run(["cluster", "secrets", "write", "--cluster", cluster],
                       json.dumps({"ray_token": TOKEN}).encode(), root)
    assert code == 2 and events[-1]["kind"] == "bad_input"


def test_a_link_where_the_cluster_directory_belongs_is_refused(root, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.makedirs(root, mode=0o700)
    os.symlink(str(elsewhere), os.path.join(root, "alpha"))
    with pytest.raises(AgentError) as caught:
        clustersecrets.write_secrets("alpha", {"ray-token": TOKEN.encode()})
    assert caught.value.kind == "not_retryable" and "link" in caught.value.message
    assert os.listdir(str(elsewhere)) == []


def test_a_link_where_the_parent_belongs_is_refused(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(str(elsewhere), str(tmp_path / "clusters"))
    monkeypatch.setenv("FADEN_AGENT_SECRETS", str(tmp_path / "clusters"))
    with pytest.raises(AgentError):
        clustersecrets.write_secrets("alpha", {"ray-token": TOKEN.encode()})
    assert os.listdir(str(elsewhere)) == []


def test_a_link_planted_as_the_token_or_its_temporary_name_is_replaced_not_followed(root, tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep")
    os.makedirs(os.path.join(root, "alpha"), mode=0o700)
    os.symlink(str(target), os.path.join(root, "alpha", "ray-token"))
    os.symlink(str(target), os.path.join(root, "alpha", ".ray-token.new"))
    clustersecrets.write_secrets("alpha", {"ray-token": TOKEN.encode()})
    assert target.read_text() == "keep"
    token = os.path.join(root, "alpha", "ray-token")
    assert not os.path.islink(token) and open(token).read() == TOKEN
    assert secretsdir.ray_token_path("alpha") == token


def test_a_wide_directory_is_narrowed_to_0700(root):
    os.makedirs(os.path.join(root, "alpha"))
    os.chmod(os.path.join(root, "alpha"), 0o777)
    clustersecrets.write_secrets("alpha", {"ray-token": TOKEN.encode()})
    assert stat.S_IMODE(os.stat(os.path.join(root, "alpha")).st_mode) == 0o700


def test_remove_takes_the_directory_and_never_follows_a_link(root, tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "file").write_text("keep")
    clustersecrets.write_secrets("alpha", {"ray-token": TOKEN.encode()})
    os.symlink(str(kept), os.path.join(root, "alpha", "link"))
    code, events = run(["cluster", "secrets", "remove", "--cluster", "alpha"], b"", root)
    assert code == 0 and events[-1]["removed"] is True
    assert not os.path.exists(os.path.join(root, "alpha")) and (kept / "file").read_text() == "keep"
    code, events = run(["cluster", "secrets", "remove", "--cluster", "alpha"], b"", root)
    assert code == 0 and events[-1]["removed"] is False
    os.symlink(str(kept), os.path.join(root, "beta"))
    assert clustersecrets.remove_secrets("beta") is True
    assert (kept / "file").read_text() == "keep"


# ------------------------------------------------------------------ what the container writes, read back


def test_the_agent_reads_what_the_container_writes_never_through_a_link(tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("root's own")
    log = tmp_path / "copy.log"
    os.symlink(str(secret), str(log))
    assert rayproc.read_tail(str(log)) == ""
    os.mkfifo(str(tmp_path / "fifo"))
    assert rayproc.read_tail(str(tmp_path / "fifo")) == ""           # no hang on a planted fifo
    (tmp_path / "real.log").write_text("engine says hi\n")
    assert rayproc.read_tail(str(tmp_path / "real.log")) == "engine says hi\n"


def test_ray_s_session_link_counts_only_inside_ray_s_temp_dir(tmp_path):
    store = tmp_path / "store"
    (store / "ray" / "session_1").mkdir(parents=True)
    link = store / "ray" / "session_latest"
    os.symlink("session_1", str(link))
    assert rayproc.session_dir(str(store)) == str(store / "ray" / "session_1")
    os.unlink(str(link))
    os.symlink("/etc", str(link))
    assert rayproc.session_dir(str(store)) is None
