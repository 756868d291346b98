"""The spec ``node files write`` reads on stdin, every part checked, and the few texts the agent
makes from it (root's SSH settings, known_hosts, the authorized key line, the profile script)::

    {"cluster": "gpu-room",
     "hostfile": "198.18.1.10 slots=2\\n...",          (clusters/connection_texts.py's, as they are)
     "cluster_env": "# ...\\nMASTER_ADDR=198.18.1.10\\n...",
     "hosts": "# fadenstack cluster nodes: begin\\n198.18.1.10 node-0\\n...# fadenstack cluster nodes: end\\n",
     "ssh": {"private_key": "-----BEGIN OPENSSH PRIVATE KEY-----...", "public_key": "ssh-ed25519 AAAA... comment",
             "allow_from": "198.18.1.0/24",
             "nodes": [{"name": "node-0", "address": "198.18.1.10", "port": 22, "host_keys": ["ssh-ed25519 AAAA..."]}]},
     "sshd": {"dropin": "<machines/sshd.py's sshd_dropin()>", "ca_public_key": "ssh-ed25519 AAAA... fadenstack-ssh-ca",
              "principals": "fadenstack-cluster-1\\nfadenstack-cluster-1-machine-3\\n",
              "revoked_keys": "<base64 of the cluster's key revocation list (OpenSSH KRL)>"}}

The server computes the cluster's files; the agent checks that each is what it claims to be
before root's shells, sshd and ssh read it: the hostfile and hosts lines name the nodes' addresses,
``cluster.env`` (sourced by every login shell) holds only shell-quoted values of cluster settings,
the drop-in says nothing but where the authority's key and the principals are.  A refusal is
``bad_input`` naming the part; the private key is never quoted, in an error or anywhere else.
"""

import base64
import binascii
import ipaddress
import json
import re
import struct

from .protocol import BAD_INPUT, AgentError

CLUSTER_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
HOSTS_BEGIN = "# fadenstack cluster nodes: begin"
HOSTS_END = "# fadenstack cluster nodes: end"
CA_KEY = "/etc/fadenstack/ssh/ca.pub"
PRINCIPALS = "/etc/fadenstack/ssh/principals/%u"
REVOKED_KEYS = "/etc/fadenstack/ssh/revoked.krl"
KRL_MAGIC = b"SSHKRL\n\0"
KRL_MAX = 4 * 1024 * 1024
ENV_PATH = "/etc/fadenstack/cluster.env"
MAX_TEXT = 256 * 1024
MAX_NODES = 1024
NODE_NAME_RE = re.compile(r"^node-(0|[1-9][0-9]{0,5})$")
# cluster.env is sourced by every root login shell with set -a: cluster settings only (never PATH,
# LD_PRELOAD, BASH_ENV, PROMPT_COMMAND...), and values as shlex.quote writes them, which the shell
# takes literally (runs of safe characters, '...' and "'").
ENV_LINE_RE = re.compile(r"^((?:MASTER|NODE|WORLD|GPUS|NCCL|GLOO|CLUSTER|FADEN)_[A-Z0-9_]*)="
                         r"((?:[A-Za-z0-9_@%+=:,./-]+|'[^']*'|\"'\")*)$")
KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa")
KEY_LINE_RE = re.compile(r"^([a-z0-9-]+) ([A-Za-z0-9+/]+={0,2})(?: ([A-Za-z0-9._:@+=,/-]{1,200}))?$")
PRINCIPAL_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,255}$")
PRIVATE_BEGIN = "-----BEGIN OPENSSH PRIVATE KEY-----"
PRIVATE_END = "-----END OPENSSH PRIVATE KEY-----"
SHAPE = ('{"cluster", "hostfile", "cluster_env", "hosts", "ssh": {"private_key", "public_key", "allow_from", '
         '"nodes": [{"name", "address", "port", "host_keys"}]}, "sshd": {"dropin", "ca_public_key", "principals", '
         '"revoked_keys"}}')

PROFILE_TEXT = """\
# Fadenstack: every login shell gets this node's cluster settings (MASTER_ADDR, NODE_RANK, ...).
# Written by the Fadenstack agent (node files write); it goes with the cluster.
if [ -r %s ]; then
    set -a; . %s; set +a
fi
""" % (ENV_PATH, ENV_PATH)


def bad(message: str):
    raise AgentError(BAD_INPUT, "the node files spec: " + message)


def _quote(value) -> str:
    if isinstance(value, str) and "PRIVATE KEY" in value:
        return "(a private key, not quoted)"  # one sent in the wrong field is still a secret
    return json.dumps(value)[:80]


def _keys(obj, where: str, allowed: set, required: set) -> dict:
    if not isinstance(obj, dict):
        bad("%s must be a JSON object %s" % (where, SHAPE))
    unknown = sorted(set(obj) - allowed)
    if unknown:
        bad("%s has unknown keys: %s" % (where, ", ".join(unknown)))
    missing = sorted(required - set(obj))
    if missing:
        bad("%s lacks %s" % (where, ", ".join(missing)))
    return obj


def _text(value, where: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT or "\0" in value or "\r" in value:
        bad("%s must be text of at most %d characters, without NUL or carriage returns" % (where, MAX_TEXT))
    return value if value == "" or value.endswith("\n") else value + "\n"


def _lines(text: str) -> list:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _ip(value, where: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        bad("%s must be an IP address, got %s" % (where, _quote(value)))


# ------------------------------------------------------------------ keys


def _ssh_string(raw: bytes, at: int):
    if at + 4 > len(raw):
        raise ValueError("cut short")
    size = struct.unpack(">I", raw[at:at + 4])[0]
    if at + 4 + size > len(raw):
        raise ValueError("cut short")
    return raw[at + 4:at + 4 + size], at + 4 + size


def check_key_line(value, where: str):
    """A public key line (``type base64 [comment]``): ``(line, blob)``, the type inside the blob
    matching the one outside."""
    match = KEY_LINE_RE.match(value.strip()) if isinstance(value, str) else None
    if not match or match.group(1) not in KEY_TYPES:
        bad("%s must be one OpenSSH public key line (%s), got %s" % (where, ", ".join(KEY_TYPES), _quote(value)))
    try:
        blob = base64.b64decode(match.group(2), validate=True)
        inner, _ = _ssh_string(blob, 0)
    except (binascii.Error, ValueError):
        inner, blob = b"", b""
    if inner != match.group(1).encode():
        bad("%s is not a %s key: its base64 does not hold one" % (where, match.group(1)))
    return match.group(0), blob


def check_private_key(value, public_blob: bytes) -> str:
    """The cluster's private key in OpenSSH's format, without a passphrase (the nodes use it
    unattended), and the private half of ``public_blob``.  Its words never go into a message."""
    lines = value.strip().splitlines() if isinstance(value, str) and len(value) < 16384 else []
    if len(lines) < 3 or lines[0] != PRIVATE_BEGIN or lines[-1] != PRIVATE_END:
        bad("ssh.private_key must be an OpenSSH private key (%s ... %s)" % (PRIVATE_BEGIN, PRIVATE_END))
    try:
        raw = base64.b64decode("".join(lines[1:-1]), validate=True)
        if not raw.startswith(b"openssh-key-v1\0"):
            raise ValueError("not openssh-key-v1")
        cipher, at = _ssh_string(raw, 15)
        _kdf, at = _ssh_string(raw, at)
        _options, at = _ssh_string(raw, at)
        public, _ = _ssh_string(raw, at + 4)
    except (binascii.Error, ValueError):
        bad("ssh.private_key is not a readable OpenSSH private key")
    if cipher != b"none":
        bad("ssh.private_key has a passphrase: the nodes use it without anyone to type one")
    if public != public_blob:
        bad("ssh.private_key is not the private half of ssh.public_key")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the spec's parts


def _check_nodes(value, network) -> list:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_NODES:
        bad("ssh.nodes must be a list of 1 to %d nodes" % MAX_NODES)
    nodes, names, addresses = [], set(), set()
    for i, raw in enumerate(value):
        where = "ssh.nodes[%d]" % i
        node = _keys(raw, where, {"name", "address", "port", "host_keys"}, {"name", "address"})
        name = node["name"]
        if not isinstance(name, str) or not NODE_NAME_RE.match(name):
            bad("%s.name must be node-<rank>, got %s" % (where, _quote(name)))
        address = _ip(node["address"], where + ".address")
        if ipaddress.ip_address(address) not in network:
            bad("%s.address %s is not on the cluster network %s" % (where, address, network))
        port = node.get("port", 22)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            bad("%s.port must be a TCP port, got %s" % (where, _quote(port)))
        if name in names or address in addresses:
            bad("%s names %s or %s a second time" % (where, name, address))
        names.add(name)
        addresses.add(address)
        host_keys = node.get("host_keys", [])
        if not isinstance(host_keys, list) or len(host_keys) > 16:
            bad("%s.host_keys must be a list of at most 16 public key lines" % where)
        keys = [check_key_line(k, "%s.host_keys[%d]" % (where, j))[0] for j, k in enumerate(host_keys)]
        nodes.append({"name": name, "address": address, "port": port, "host_keys": keys})
    return nodes


def _check_hosts(value, nodes: list) -> str:
    text = _text(value, "hosts")
    lines = text.splitlines()
    if len(lines) < 2 or lines[0] != HOSTS_BEGIN or lines[-1] != HOSTS_END:
        bad("hosts must be the block between %r and %r" % (HOSTS_BEGIN, HOSTS_END))
    pairs = []
    for line in lines[1:-1]:
        words = line.split()
        if len(words) != 2 or not NODE_NAME_RE.match(words[1]):
            bad("hosts line %s is not '<address> node-<rank>'" % _quote(line))
        pairs.append((_ip(words[0], "hosts line %s" % _quote(line)), words[1]))
    if sorted(pairs) != sorted((n["address"], n["name"]) for n in nodes):
        bad("hosts and ssh.nodes name different nodes")
    return "".join(line + "\n" for line in lines[1:-1])


def _check_hostfile(value, nodes: list) -> str:
    text = _text(value, "hostfile")
    addresses = {n["address"] for n in nodes}
    for line in _lines(text):
        words = line.split()
        if len(words) != 2 or not re.match(r"^slots=[0-9]{1,4}$", words[1]):
            bad("hostfile line %s is not '<address> slots=<gpus>'" % _quote(line))
        if _ip(words[0], "hostfile line %s" % _quote(line)) not in addresses:
            bad("hostfile line %s names none of the nodes" % _quote(line))
    return text


def _check_env(value) -> str:
    text = _text(value, "cluster_env")
    for line in _lines(text):
        if not ENV_LINE_RE.match(line):
            bad("cluster_env line %s is not NAME=value with a cluster setting's name (MASTER_, NODE_, WORLD_, "
                "GPUS_, NCCL_, GLOO_, CLUSTER_ or FADEN_) and a shell-quoted value" % _quote(line))
    return text


def check_krl(data: bytes, where: str) -> bytes:
    """An OpenSSH key revocation list: its magic and format version 1, at most KRL_MAX bytes. sshd reads
    the rest; a file it cannot read would refuse every public key login, so nothing else passes."""
    if not isinstance(data, bytes) or len(data) > KRL_MAX or len(data) < 44 or not data.startswith(KRL_MAGIC) \
            or struct.unpack(">I", data[8:12])[0] != 1:
        bad("%s must be an OpenSSH key revocation list (format 1, at most %d bytes)" % (where, KRL_MAX))
    return data


def _check_sshd(value) -> dict:
    sshd = _keys(value, "sshd", {"dropin", "ca_public_key", "principals", "revoked_keys"},
                 {"dropin", "ca_public_key", "principals"})
    dropin = _text(sshd["dropin"], "sshd.dropin")
    wanted = {"trustedusercakeys": CA_KEY, "authorizedprincipalsfile": PRINCIPALS}
    if "revoked_keys" in sshd:
        wanted["revokedkeys"] = REVOKED_KEYS
    said = {}
    for line in _lines(dropin):
        words = line.split()
        if len(words) != 2 or words[0].lower() not in wanted or wanted[words[0].lower()] != words[1]:
            bad("sshd.dropin may only say TrustedUserCAKeys %s, AuthorizedPrincipalsFile %s and (with "
                "sshd.revoked_keys) RevokedKeys %s, not %s" % (CA_KEY, PRINCIPALS, REVOKED_KEYS, _quote(line)))
        said[words[0].lower()] = words[1]
    if sorted(said) != sorted(wanted):
        bad("sshd.dropin must say %s" % " and ".join("%s %s" % (k, v) for k, v in sorted(wanted.items())))
    ca_line, _ = check_key_line(sshd["ca_public_key"], "sshd.ca_public_key")
    principals = _text(sshd["principals"], "sshd.principals")
    names = principals.splitlines()
    if not 1 <= len(names) <= 256 or not all(PRINCIPAL_RE.match(name) for name in names):
        bad("sshd.principals must be 1 to 256 lines, each one principal (letters, digits, . _ : @ -)")
    checked = {"dropin": dropin, "ca_public_key": ca_line + "\n", "principals": principals, "revoked_keys": None}
    if "revoked_keys" in sshd:
        try:
            raw = base64.b64decode(sshd["revoked_keys"], validate=True) if isinstance(sshd["revoked_keys"], str) else None
        except (binascii.Error, ValueError):
            raw = None
        checked["revoked_keys"] = check_krl(raw, "sshd.revoked_keys")
    return checked


def check_spec(spec) -> dict:
    """The spec, every part checked; what ``node files write`` writes."""
    top = {"cluster", "hostfile", "cluster_env", "hosts", "ssh", "sshd"}
    spec = _keys(spec, "the spec", top, top)
    cluster = spec["cluster"]
    if not isinstance(cluster, str) or not CLUSTER_RE.match(cluster):
        bad("cluster must be a cluster name (lowercase letters, digits, dashes), got %s" % _quote(cluster))
    ssh = _keys(spec["ssh"], "ssh", {"private_key", "public_key", "allow_from", "nodes"},
                {"private_key", "public_key", "allow_from", "nodes"})
    try:
        network = ipaddress.ip_network(ssh["allow_from"], strict=False)
    except (TypeError, ValueError):
        bad("ssh.allow_from must be the cluster's subnet (CIDR), got %s" % _quote(ssh["allow_from"]))
    public_key, blob = check_key_line(ssh["public_key"], "ssh.public_key")
    private_key = check_private_key(ssh["private_key"], blob)
    nodes = _check_nodes(ssh["nodes"], network)
    return {
        "cluster": cluster, "hostfile": _check_hostfile(spec["hostfile"], nodes), "cluster_env": _check_env(spec["cluster_env"]),
        "hosts_body": _check_hosts(spec["hosts"], nodes),
        "ssh": {"private_key": private_key, "public_key": public_key, "allow_from": str(network), "nodes": nodes},
        "sshd": _check_sshd(spec["sshd"]),
    }


# ------------------------------------------------------------------ texts the agent makes


def strict_checking(nodes: list) -> str:
    """``yes`` when every node's host keys came with the spec; else ``accept-new`` (the first
    connection to a node records its key, a changed key is refused)."""
    return "yes" if all(n["host_keys"] for n in nodes) else "accept-new"


def _host(name: str, port: int) -> str:
    return name if port == 22 else "[%s]:%d" % (name, port)


def known_hosts_text(cluster: str, nodes: list) -> str:
    lines = ["# The host keys of the cluster %s's nodes (written by the Fadenstack agent)." % cluster]
    for n in nodes:
        names = ",".join((_host(n["name"], n["port"]), _host(n["address"], n["port"])))
        lines += ["%s %s" % (names, key.split()[0] + " " + key.split()[1]) for key in n["host_keys"]]
    return "\n".join(lines) + "\n"


def ssh_config_body(cluster: str, nodes: list, key_path: str, known_hosts: str) -> str:
    """Root's SSH settings for the nodes: each name and address with its port, the cluster's key
    and known_hosts.  The block goes at the top of ``~/.ssh/config`` (ssh takes the first value it
    reads, so a ``Host *`` further down does not override ours) and ends with ``Host *``, so that
    settings the file had before any ``Host`` line still apply to every host."""
    lines = ["# The cluster %s's own SSH between its nodes (written by the Fadenstack agent)." % cluster]
    for n in nodes:
        lines += ["Host %s %s" % (n["name"], n["address"]), "    HostName %s" % n["address"]]
        lines += ["    Port %d" % n["port"]] if n["port"] != 22 else []
    lines += ["Host node-* " + " ".join(n["address"] for n in nodes), "    User root",
              "    IdentityFile %s" % key_path, "    IdentitiesOnly yes", "    UserKnownHostsFile %s" % known_hosts,
              "    StrictHostKeyChecking %s" % strict_checking(nodes), "Host *"]
    return "\n".join(lines) + "\n"


def authorized_body(public_key: str, allow_from: str) -> str:
    """The cluster's key, accepted only from the cluster's network."""
    return 'from="%s" %s\n' % (allow_from, public_key)
