"""``node files write|remove``: the real agent as a subprocess on a pretend machine (a temporary
``/`` through FADEN_NODE_FILES_ROOT) with an sshd stand-in (FADEN_NODE_FILES_SSHD), checked by the
real ssh, ssh-keygen and sh where they are installed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.agent.imagehelpers import AGENT_DIR, PYTHON

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
HOSTS_BEFORE = b"127.0.0.1\tlocalhost\n10.0.0.5\tbackup  # kept\n10.0.0.6\tprinter"  # no newline at its end
SSH_CONFIG_BEFORE = b"ServerAliveInterval 30\nHost gitlab\n    User git\n"
CONSOLE_KEY = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl console\n"
DEBIAN_SSHD = b"Include /etc/ssh/sshd_config.d/*.conf\nPermitRootLogin prohibit-password\n"
DROPIN = ("# Fadenstack: logins with a certificate signed by the console's SSH certificate authority.\n"
          "TrustedUserCAKeys /etc/fadenstack/ssh/ca.pub\nAuthorizedPrincipalsFile /etc/fadenstack/ssh/principals/%u\n")

# The sshd stand-in: -T prints what a Debian sshd would (pidfile and authorized keys from the
# environment), with the TrustedUserCAKeys it finds through the configuration's Includes; -t
# refuses a configuration whose files (the CA key included) hold FAKE_SSHD_REFUSE; FAKE_SSHD_BROKEN
# makes both refuse. Every run is logged to FAKE_SSHD_LOG.
FAKE_SSHD = r'''
import glob, os, sys
root = os.environ["FADEN_NODE_FILES_ROOT"]
args = sys.argv[1:]
with open(os.environ["FAKE_SSHD_LOG"], "a") as log:
    log.write(" ".join(args) + "\n")
real = lambda path: os.path.join(root, path.lstrip("/"))
def texts(path):
    found = [open(path).read()]
    for line in found[0].splitlines():
        words = line.split()
        if words and words[0].lower() == "include":
            for pattern in words[1:]:
                for name in sorted(glob.glob(real(pattern if pattern.startswith("/") else "/etc/ssh/" + pattern))):
                    found += texts(name)
    return found
files = texts(args[args.index("-f") + 1])
ca = next((line.split()[1] for text in files for line in text.splitlines()
           if line.lower().startswith("trustedusercakeys")), "none")
if ca != "none" and os.path.exists(real(ca)):
    files.append(open(real(ca)).read())
if os.environ.get("FAKE_SSHD_BROKEN"):
    sys.stderr.write("/etc/ssh/sshd_config line 2: Bad configuration option: PermitRotLogin\n")
    sys.exit(255)
if "-t" in args:
    refuse = os.environ.get("FAKE_SSHD_REFUSE")
    if refuse and any(refuse in text for text in files):
        sys.stderr.write("/etc/fadenstack/ssh/ca.pub: the stand-in refuses this authority\n")
        sys.exit(255)
    sys.exit(0)
print("port 22")
print("pidfile " + os.environ.get("FAKE_SSHD_PIDFILE", "/run/sshd.pid"))
print("authorizedkeysfile " + os.environ.get("FAKE_SSHD_KEYS", ".ssh/authorized_keys .ssh/authorized_keys2"))
print("trustedusercakeys " + ca)
'''


def key_pair(comment: str):
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode()
    public = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    return pem, f"{public} {comment}"


NODE_PRIVATE, NODE_PUBLIC = key_pair("fadenstack-cluster-gpu-room")
CA_PUBLIC = key_pair("fadenstack-ssh-ca")[1]
HOST_KEYS = {name: key_pair(f"root@lab-{name[-1]}")[1] for name in ("node-0", "node-1")}


def spec(addresses=("198.18.1.10", "198.18.1.11"), host_keys=True, **changes) -> dict:
    nodes = [{"name": f"node-{rank}", "address": address, "port": 22,
              "host_keys": [HOST_KEYS[f"node-{rank}"]] if host_keys and rank < 2 else []}
             for rank, address in enumerate(addresses)]
    body = {
        "cluster": "gpu-room",
        "hostfile": "".join(f"{a} slots=2\n" for a in addresses),
        "cluster_env": (f"# This node's place in its Fadenstack cluster.\nMASTER_ADDR={addresses[0]}\nMASTER_PORT=29500\n"
                        f"NODE_RANK=1\nWORLD_NODES={len(addresses)}\nGPUS_PER_NODE=2\nNCCL_SOCKET_IFNAME==eth1\n"
                        "GLOO_SOCKET_IFNAME=eth1\n"),
        "hosts": "# fadenstack cluster nodes: begin\n" + "".join(f"{n['address']} {n['name']}\n" for n in nodes)
                 + "# fadenstack cluster nodes: end\n",
        "ssh": {"private_key": NODE_PRIVATE, "public_key": NODE_PUBLIC, "allow_from": "198.18.1.0/24", "nodes": nodes},
        "sshd": {"dropin": DROPIN, "ca_public_key": CA_PUBLIC, "principals": "fadenstack-cluster-1\nfadenstack-cluster-1-machine-3\n"},
    }
    for key, value in changes.items():
        part, _, sub = key.partition("__")
        if sub:
            body[part] = dict(body[part], **{sub: value})
        else:
            body[part] = value
    return body


class Node:
    """A pretend machine: a Debian-like /etc, root's SSH files, and the sshd stand-in."""

    def __init__(self, tmp_path, sshd_config=DEBIAN_SSHD):
        self.root = tmp_path / "machine"
        self.log = tmp_path / "sshd.log"
        for data, path in ((HOSTS_BEFORE, "etc/hosts"), (sshd_config, "etc/ssh/sshd_config"),
                           (CONSOLE_KEY, "root/.ssh/authorized_keys"), (SSH_CONFIG_BEFORE, "root/.ssh/config")):
            self.file(path).parent.mkdir(parents=True, exist_ok=True)
            self.file(path).write_bytes(data)
        os.chmod(self.file("root/.ssh"), 0o700)
        fake = tmp_path / "fake-sshd"
        fake.write_text(f"#!{sys.executable}\n{FAKE_SSHD}")
        fake.chmod(0o755)
        self.env = dict(os.environ, PYTHONPATH=AGENT_DIR, PYTHONDONTWRITEBYTECODE="1",
                        FADEN_AGENT_HOME=str(tmp_path / "agent-home"), FADEN_NODE_FILES_ROOT=str(self.root),
                        FADEN_NODE_FILES_SSHD=str(fake), FAKE_SSHD_LOG=str(self.log))

    def file(self, path: str):
        return self.root / path.lstrip("/")

    def run(self, action: str, body=None, prefix=()):
        stdin = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        proc = subprocess.run([*prefix, PYTHON, "-m", "fadenstack_agent", "node", "files", action], input=stdin,
                              capture_output=True, env=self.env, timeout=60)
        events = [json.loads(line) for line in proc.stdout.decode().splitlines()]
        assert events and events[-1]["event"] in ("result", "error") and "Traceback" not in proc.stderr.decode(), proc
        return proc.returncode, events[-1]

    def write(self, body=None):
        code, last = self.run("write", spec() if body is None else body)
        assert code == 0, last
        return last

    def sshd_runs(self, flag: str) -> int:
        """How many times the stand-in ran with ``flag`` (-t or -T)."""
        return [line.split()[0] for line in self.log.read_text().splitlines()].count(flag) if self.log.exists() else 0

    def tree(self) -> dict:
        """Every file under the machine's root: its bytes and mode."""
        found = {}
        for top, _, names in os.walk(self.root):
            for name in names:
                path = os.path.join(top, name)
                found[os.path.relpath(path, self.root)] = (open(path, "rb").read(), os.stat(path).st_mode & 0o7777)
        return found


@pytest.fixture
def node(tmp_path):
    return Node(tmp_path)


def test_write_puts_every_file_with_its_content_and_mode(node):
    result = node.write()

    assert result["changed"] is True and result["cluster"] == "gpu-room"
    assert node.file("/etc/fadenstack/hostfile").read_text() == "198.18.1.10 slots=2\n198.18.1.11 slots=2\n"
    assert "MASTER_ADDR=198.18.1.10\n" in node.file("/etc/fadenstack/cluster.env").read_text()
    assert "set -a; . /etc/fadenstack/cluster.env; set +a" in node.file("/etc/profile.d/fadenstack-cluster.sh").read_text()
    assert node.file("/root/.ssh/fadenstack_cluster").read_text() == NODE_PRIVATE
    assert node.file("/etc/fadenstack/ssh/ca.pub").read_text() == CA_PUBLIC + "\n"
    assert node.file("/etc/fadenstack/ssh/principals/root").read_text() == "fadenstack-cluster-1\nfadenstack-cluster-1-machine-3\n"
    assert node.file("/etc/ssh/sshd_config.d/fadenstack-ca.conf").read_text() == DROPIN
    modes = {path: os.stat(node.file(path)).st_mode & 0o777 for path in (
        "/etc/fadenstack/hostfile", "/etc/fadenstack/cluster.env", "/etc/profile.d/fadenstack-cluster.sh",
        "/etc/fadenstack/known_hosts", "/etc/fadenstack/ssh/ca.pub", "/etc/fadenstack/ssh/principals/root",
        "/etc/ssh/sshd_config.d/fadenstack-ca.conf", "/root/.ssh/fadenstack_cluster")}
    assert modes.pop("/root/.ssh/fadenstack_cluster") == 0o600
    assert set(modes.values()) == {0o644}
    assert "/etc/hosts" in result["paths"] and "/root/.ssh/authorized_keys" in result["paths"]
    # Debian's sshd_config includes the drop-in directory already: it is left as it was.
    assert node.file("/etc/ssh/sshd_config").read_bytes() == DEBIAN_SSHD and result["sshd"]["include_added"] is False
    assert result["sshd"]["checked"] is True and result["host_key_checking"] == "yes"
    assert node.sshd_runs("-t") == 1


def test_the_blocks_go_into_the_shared_files_and_leave_their_other_lines(node):
    node.write()

    hosts = node.file("/etc/hosts").read_bytes()
    assert hosts.startswith(HOSTS_BEFORE + b"\n# fadenstack cluster nodes: begin\n198.18.1.10 node-0\n")
    keys = node.file("/root/.ssh/authorized_keys").read_text()
    assert keys.startswith(CONSOLE_KEY.decode())
    assert f'from="198.18.1.0/24" {NODE_PUBLIC}\n' in keys
    config = node.file("/root/.ssh/config").read_text()
    assert config.endswith("Host *\n# fadenstack cluster nodes: end\n" + SSH_CONFIG_BEFORE.decode())
    assert "IdentityFile /root/.ssh/fadenstack_cluster" in config and "StrictHostKeyChecking yes" in config


def test_a_second_write_of_the_same_spec_changes_nothing_and_reloads_nothing(node):
    node.write()
    before, runs = node.tree(), node.sshd_runs("-t")

    again = node.write()

    assert again["changed"] is False and again["paths"] == []
    assert again["sshd"]["reloaded"] is None and node.sshd_runs("-t") == runs
    assert node.tree() == before


def test_a_new_spec_replaces_the_blocks_in_place_instead_of_adding_them(node):
    node.write()
    result = node.write(spec(addresses=("198.18.1.10", "198.18.1.11", "198.18.1.12")))

    hosts = node.file("/etc/hosts").read_text()
    assert hosts.count("# fadenstack cluster nodes: begin") == 1 and "198.18.1.12 node-2\n" in hosts
    assert hosts.startswith(HOSTS_BEFORE.decode() + "\n")
    assert node.file("/root/.ssh/authorized_keys").read_text().count(NODE_PUBLIC) == 1
    config = node.file("/root/.ssh/config").read_text()
    assert config.count("# fadenstack cluster nodes: begin") == 1 and "Host node-2 198.18.1.12" in config
    # known_hosts is as it was: the new node's host key did not come with the spec.
    assert set(result["paths"]) == {"/etc/fadenstack/hostfile", "/etc/fadenstack/cluster.env", "/etc/hosts",
                                    "/root/.ssh/config"}
    # Its first connection records it.
    assert result["host_key_checking"] == "accept-new" and "StrictHostKeyChecking accept-new" in config


def test_remove_leaves_every_file_as_it_was_before_the_first_write_byte_for_byte(node):
    before = node.tree()
    node.write()
    node.write(spec(addresses=("198.18.1.10", "198.18.1.11", "198.18.1.12")))

    code, result = node.run("remove")

    assert code == 0 and result["changed"] is True
    assert node.tree() == before
    assert "/etc/fadenstack/hostfile" in result["removed"] and "/etc/fadenstack/ssh" in result["removed"]
    assert "/etc/hosts" in result["paths"] and result["restored"] == []
    assert sorted(os.listdir(node.root / "etc")) == ["hosts", "ssh"]


def test_remove_again_changes_nothing(node):
    node.write()
    node.run("remove")
    before = node.tree()

    code, result = node.run("remove")

    assert code == 0 and result["changed"] is False and result["paths"] == [] and node.tree() == before


def test_a_dropin_that_was_there_before_comes_back_on_remove(node):
    enrolment = b"TrustedUserCAKeys /etc/fadenstack/ssh/ca.pub\nAuthorizedPrincipalsFile /etc/fadenstack/ssh/principals/%u\n"
    node.file("/etc/ssh/sshd_config.d").mkdir()
    node.file("/etc/ssh/sshd_config.d/fadenstack-ca.conf").write_bytes(enrolment)
    node.write()

    code, result = node.run("remove")

    assert code == 0 and result["restored"] == ["/etc/ssh/sshd_config.d/fadenstack-ca.conf"]
    assert node.file("/etc/ssh/sshd_config.d/fadenstack-ca.conf").read_bytes() == enrolment


def test_an_sshd_config_without_include_gets_one_at_its_top_and_loses_it_on_remove(tmp_path):
    plain = b"Port 22\nPermitRootLogin prohibit-password\n"
    node = Node(tmp_path, sshd_config=plain)

    result = node.write()

    config = node.file("/etc/ssh/sshd_config").read_bytes()
    assert config == (b"# fadenstack sshd drop-in: begin\nInclude /etc/ssh/sshd_config.d/fadenstack-ca.conf\n"
                      b"# fadenstack sshd drop-in: end\n" + plain)
    assert result["sshd"]["include_added"] is True and "/etc/ssh/sshd_config" in result["paths"]
    # The stand-in's sshd -T reads the drop-in through the Include: no warning that certificates stay off.
    assert not any("TrustedUserCAKeys" in warning for warning in result["warnings"])

    node.run("remove")
    assert node.file("/etc/ssh/sshd_config").read_bytes() == plain


def test_sshd_refusing_the_change_puts_the_previous_sshd_files_back_and_says_why(node):
    node.write()
    before = node.tree()
    other_ca = key_pair("fadenstack-ssh-ca")[1]
    node.env["FAKE_SSHD_REFUSE"] = other_ca.split()[1]

    code, error = node.run("write", spec(sshd__ca_public_key=other_ca))

    assert (code, error["event"], error["kind"]) == (1, "error", "not_retryable")
    assert "the stand-in refuses this authority" in error["message"] and "previous files are back" in error["message"]
    assert node.file("/etc/fadenstack/ssh/ca.pub").read_text() == CA_PUBLIC + "\n"
    assert node.tree() == before


def test_sshd_refusing_its_configuration_before_any_change_changes_nothing(node):
    before = node.tree()
    node.env["FAKE_SSHD_BROKEN"] = "1"

    code, error = node.run("write", spec())

    assert code == 1 and error["kind"] == "not_retryable" and "PermitRotLogin" in error["message"]
    assert "nothing was changed" in error["message"] and node.tree() == before


def test_a_changed_dropin_reloads_the_sshd_named_by_its_pid_file(node):
    # SIGHUP's default action, even when this run came with it ignored (under nohup): sshd's is a handler.
    listener = subprocess.Popen(["bash", "-c", "exec -a sshd-standin sleep 60"],
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 5
        while b"sshd" not in open(f"/proc/{listener.pid}/cmdline", "rb").read() and time.monotonic() < deadline:
            time.sleep(0.02)
        node.file("/run").mkdir()
        node.file("/run/sshd.pid").write_text(f"{listener.pid}\n")

        result = node.write()

        assert result["sshd"]["reloaded"] == f"SIGHUP to sshd (pid {listener.pid})"
        assert listener.wait(timeout=5) == -signal.SIGHUP
    finally:
        listener.kill()
        listener.wait()


def test_without_a_running_sshd_the_write_says_sshd_reads_the_files_at_its_next_start(node):
    result = node.write()

    assert result["sshd"]["reloaded"] is None
    assert any("when it next starts" in w for w in result["warnings"])


def test_the_authorized_key_goes_to_the_file_sshd_reads(node):
    node.env["FAKE_SSHD_KEYS"] = "/run/fadenstack-lab/ssh/authorized_keys"
    node.file("/run/fadenstack-lab/ssh").mkdir(parents=True)
    node.file("/run/fadenstack-lab/ssh/authorized_keys").write_bytes(CONSOLE_KEY)

    node.write()

    assert node.file("/run/fadenstack-lab/ssh/authorized_keys").read_text().count(NODE_PUBLIC) == 1
    assert node.file("/root/.ssh/authorized_keys").read_bytes() == CONSOLE_KEY
    node.run("remove")
    assert node.file("/run/fadenstack-lab/ssh/authorized_keys").read_bytes() == CONSOLE_KEY


@pytest.mark.parametrize(("change", "words"), [
    ({"hostfile": "198.18.1.10 slots=2 extra\n"}, "hostfile line"),
    ({"hostfile": "10.9.9.9 slots=2\n"}, "names none of the nodes"),
    ({"cluster_env": "PATH=/tmp/evil\n"}, "cluster setting's name"),
    ({"cluster_env": "MASTER_ADDR=$(touch /tmp/owned)\n"}, "shell-quoted value"),
    ({"hosts": "198.18.1.10 node-0\n"}, "hosts must be the block"),
    ({"hosts": "# fadenstack cluster nodes: begin\n198.18.1.10 node-0\n# fadenstack cluster nodes: end\n"},
     "different nodes"),
    ({"sshd__dropin": DROPIN + "PasswordAuthentication yes\n"}, "may only say"),
    ({"sshd__principals": "two words\n"}, "sshd.principals"),
    ({"ssh__allow_from": "10.0.0.0/24"}, "not on the cluster network"),
    ({"ssh__public_key": key_pair("another")[1]}, "not the private half"),
    ({"ssh__private_key": NODE_PRIVATE.replace("KEY-----\n", "KEY-----\nAAAA", 1)}, "ssh.private_key"),
    ({"cluster": "Gpu Room"}, "cluster must be"),
    ({"extra": 1}, "unknown keys: extra"),
])
def test_a_bad_spec_is_bad_input_with_a_sentence_and_no_key_in_it(node, change, words):
    before = node.tree()

    code, error = node.run("write", spec(**change))

    assert (code, error["kind"]) == (2, "bad_input") and words in error["message"], error
    assert NODE_PRIVATE.splitlines()[1][:20] not in error["message"]
    assert node.tree() == before


def test_a_spec_that_is_not_json_is_bad_input(node):
    code, error = node.run("write", b"{not json")

    assert (code, error["kind"]) == (2, "bad_input") and "not valid JSON" in error["message"]


@pytest.mark.skipif(shutil.which("ssh") is None, reason="the OpenSSH client is not installed")
def test_ssh_reads_the_nodes_settings_and_keeps_the_files_own_for_other_hosts(node):
    node.write()
    config = str(node.file("/root/.ssh/config"))

    def effective(host):
        out = subprocess.run(["ssh", "-G", "-F", config, host], capture_output=True, text=True, check=True).stdout
        return dict(line.split(" ", 1) for line in out.splitlines())

    seen = effective("node-1")
    assert (seen["hostname"], seen["user"], seen["stricthostkeychecking"]) == ("198.18.1.11", "root", "true")
    assert seen["identityfile"] == "/root/.ssh/fadenstack_cluster" and seen["identitiesonly"] == "yes"
    assert seen["userknownhostsfile"] == "/etc/fadenstack/known_hosts"
    assert effective("198.18.1.10")["identityfile"] == "/root/.ssh/fadenstack_cluster"
    other = effective("gitlab")
    assert other["user"] == "git" and other["serveraliveinterval"] == "30"
    assert other["identityfile"] != "/root/.ssh/fadenstack_cluster"


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="ssh-keygen is not installed")
def test_ssh_keygen_finds_each_node_by_name_and_address_in_the_known_hosts(node):
    node.write()
    known = str(node.file("/etc/fadenstack/known_hosts"))

    for host in ("node-1", "198.18.1.11"):
        found = subprocess.run(["ssh-keygen", "-F", host, "-f", known], capture_output=True, text=True)
        assert found.returncode == 0 and HOST_KEYS["node-1"].split()[1] in found.stdout
    keys = subprocess.run(["ssh-keygen", "-l", "-f", str(node.file("/root/.ssh/authorized_keys"))],
                          capture_output=True, text=True, check=True).stdout
    assert len(keys.splitlines()) == 2  # the console's key and the cluster's, options and all


def test_a_login_shell_gets_the_cluster_settings_exported(node):
    node.write()
    profile = node.file("/etc/profile.d/fadenstack-cluster.sh").read_text()
    profile = profile.replace("/etc/fadenstack/cluster.env", str(node.file("/etc/fadenstack/cluster.env")))

    out = subprocess.run(["env", "-i", "sh", "-c", profile + "\nenv"], capture_output=True, text=True, check=True).stdout

    assert "MASTER_ADDR=198.18.1.10" in out.splitlines() and "NCCL_SOCKET_IFNAME==eth1" in out.splitlines()


def _real_sshd_prefix():
    """Run under a private /run holding /run/sshd when the host has none (sshd insists on it)."""
    if os.path.isdir("/run/sshd"):
        return ()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("sshd needs /run/sshd, and only root with unshare can give it one here")
    return ("unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs tmpfs /run && mkdir /run/sshd && exec "$0" "$@"')


@pytest.mark.skipif(SSHD is None or shutil.which("ssh-keygen") is None, reason="sshd is not installed")
def test_a_real_sshd_tells_where_roots_keys_are_and_accepts_the_include(tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "host_key")], check=True)
    config = f"HostKey {tmp_path}/host_key\nAuthorizedKeysFile /etc/lab/authorized_keys\nPidFile none\n".encode()
    node = Node(tmp_path, sshd_config=config)
    node.env["FADEN_NODE_FILES_SSHD"] = SSHD
    prefix = _real_sshd_prefix()

    code, result = node.run("write", spec(), prefix=prefix)

    assert code == 0, result
    assert node.file("/etc/ssh/sshd_config").read_bytes().startswith(b"# fadenstack sshd drop-in: begin\nInclude ")
    assert NODE_PUBLIC in node.file("/etc/lab/authorized_keys").read_text()
    assert result["sshd"]["checked"] is True
    code, result = node.run("remove", prefix=prefix)
    assert code == 0 and node.file("/etc/ssh/sshd_config").read_bytes() == config
    assert not node.file("/etc/lab/authorized_keys").exists()


def test_the_spec_shape_in_the_docs_is_the_one_the_agent_reads():
    doc = open(os.path.join(os.path.dirname(AGENT_DIR), "docs", "agent-protocol.md")).read()
    section = doc.split("### `node files write`", 1)[1].split("\n### ", 1)[0]
    for key in ("hostfile", "cluster_env", "hosts", "private_key", "public_key", "allow_from", "host_keys", "dropin",
                "ca_public_key", "principals"):
        assert f'"{key}"' in section, key


# -- the cluster's key revocation list ------------------------------------------------------------------------

REVOKED_DROPIN = DROPIN + "RevokedKeys /etc/fadenstack/ssh/revoked.krl\n"
EMPTY_KRL = b"SSHKRL\n\0" + (1).to_bytes(4, "big") + (1).to_bytes(8, "big") + (0).to_bytes(8, "big") * 2 + bytes(8)


def krl_with(serial: int) -> bytes:
    """A KRL revoking one serial of CA_PUBLIC's, as machines/ssh_krl.py makes it."""
    import base64
    import struct

    string = lambda data: struct.pack(">I", len(data)) + data  # noqa: E731
    blob = base64.b64decode(CA_PUBLIC.split()[1])
    body = string(blob) + string(b"") + bytes([0x20]) + string(struct.pack(">Q", serial))
    return EMPTY_KRL[:12] + (2).to_bytes(8, "big") + EMPTY_KRL[20:] + bytes([1]) + string(body)


def revocations(node, data: bytes, cluster: str = "gpu-room"):
    proc = subprocess.run([PYTHON, "-m", "fadenstack_agent", "node", "revocations", "write", "--cluster", cluster],
                          input=data, capture_output=True, env=node.env, timeout=60)
    events = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert events and "Traceback" not in proc.stderr.decode(), proc
    return proc.returncode, events[-1]


def test_the_revocation_list_comes_with_the_node_settings_before_the_dropin_names_it(node):
    import base64

    node.write(spec(sshd__dropin=REVOKED_DROPIN, sshd__revoked_keys=base64.b64encode(EMPTY_KRL).decode()))

    assert node.file("/etc/fadenstack/ssh/revoked.krl").read_bytes() == EMPTY_KRL
    assert os.stat(node.file("/etc/fadenstack/ssh/revoked.krl")).st_mode & 0o777 == 0o644
    assert "RevokedKeys /etc/fadenstack/ssh/revoked.krl" in node.file("/etc/ssh/sshd_config.d/fadenstack-ca.conf").read_text()
    # A drop-in naming RevokedKeys without a list to write is refused: sshd would refuse every public key.
    code, last = node.run("write", spec(sshd__dropin=REVOKED_DROPIN))
    assert code == 2 and "RevokedKeys" in last["message"]
    code, last = node.run("write", spec(sshd__dropin=REVOKED_DROPIN, sshd__revoked_keys=base64.b64encode(b"not a krl").decode()))
    assert code == 2 and "key revocation list" in last["message"]
    # Remove takes it away with the rest.
    node.run("remove")
    assert not node.file("/etc/fadenstack/ssh/revoked.krl").exists()


def test_revocations_write_replaces_the_list_of_the_clusters_node_only(node):
    import base64

    code, last = revocations(node, krl_with(7))
    assert code == 1 and last["kind"] == "not_retryable" and "node settings of no cluster" in last["message"]
    node.write(spec(sshd__dropin=REVOKED_DROPIN, sshd__revoked_keys=base64.b64encode(EMPTY_KRL).decode()))
    reloads = node.sshd_runs("-t")

    code, last = revocations(node, krl_with(7))

    assert code == 0 and last["changed"] is True and last["path"] == "/etc/fadenstack/ssh/revoked.krl"
    assert node.file("/etc/fadenstack/ssh/revoked.krl").read_bytes() == krl_with(7)
    assert node.sshd_runs("-t") == reloads  # sshd reads the list at every login: nothing to check or reload
    assert revocations(node, krl_with(7))[1]["changed"] is False
    code, last = revocations(node, krl_with(8), cluster="other-room")
    assert code == 1 and "node settings of gpu-room, not of other-room" in last["message"]
    code, last = revocations(node, b"SSHKRL but not one")
    assert code == 2 and last["kind"] == "bad_input"
    assert node.file("/etc/fadenstack/ssh/revoked.krl").read_bytes() == krl_with(7)
