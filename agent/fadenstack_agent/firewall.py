"""``firewall write|remove|status --cluster C``: the cluster's own nftables table on this machine.

One table per cluster, ``inet fadenstack_<cluster>`` (the name's hyphens as underscores), that the
agent owns whole.  Its one chain hooks ``input`` and, for the cluster's ports only, lets in:

- Ray's ports (``ports.RAY_SINGLE``, ``ports.HEAD_METRICS``, ``ports.RAY_RANGES`` and the cluster's GCS port): the members;
- the copies' ports (the console's ``FADEN_COPY_PORTS``): the members, the console and the gateway;
- the file server's port (the console's ``SERVE_PORT``): the members and the console;

loopback and established or related traffic always; every other packet to those ports (TCP or UDP)
is dropped.  Other ports (SSH above all) are left to the machine's own firewall: the chain's policy
is ``accept``.  The spec arrives on stdin::

    {"members": ["198.18.1.11", "198.18.1.12"],     (the members' addresses on the cluster's network)
     "console": ["198.18.0.1"],                      (where the console's connections come from)
     "gateway": ["198.18.1.1"],                      (where the gateway's connections come from)
     "ports": {"gcs": 6379, "copies": [8100, 8199], "files": 7470}}

Addresses may be networks (``10.0.0.0/24``).  Every part is checked and the ruleset is text built
here, never through a shell; ``nft -f -`` reads it in one transaction that deletes the table and
makes it again (and deletes any other cluster's table left on the machine: its ports are the same),
so a rewrite never leaves half a firewall.
"""

import ipaddress
import json
import os
import re
import shutil
import subprocess

from . import ports
from .blobspec import read_spec
from .cli import arg, command, group
from .protocol import BAD_INPUT, NOT_RETRYABLE, RETRYABLE, AgentError

CLUSTER_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
TABLE_PREFIX = "fadenstack_"
FAMILY = "inet"
MAX_ADDRESSES = 4096
NFT_TIMEOUT = 60
SHAPE = ('{"members": [ADDRESS, ...], "console": [ADDRESS, ...], "gateway": [ADDRESS, ...], '
         '"ports": {"gcs": PORT, "copies": [LOW, HIGH], "files": PORT}}')
NFT_PLACES = ("/usr/sbin/nft", "/sbin/nft", "/usr/local/sbin/nft")

group("firewall", help="the cluster's own nftables table on this machine")


# ------------------------------------------------------------------ names and the spec


def cluster_name(text: str) -> str:
    """argparse type: a cluster's name as the console makes them (lower case, digits, hyphens)."""
    if not isinstance(text, str) or not CLUSTER_RE.fullmatch(text):
        raise AgentError(BAD_INPUT, "the cluster's name must be 1 to 63 lower-case letters, digits and hyphens, "
                                    "not starting or ending with a hyphen, got %s" % json.dumps(text)[:80])
    return text


def table_name(cluster: str) -> str:
    """The table the agent owns for ``cluster`` (names hold no underscore, so no two clusters share one)."""
    return TABLE_PREFIX + cluster_name(cluster).replace("-", "_")


def _bad(message: str):
    return AgentError(BAD_INPUT, "firewall spec: %s (the spec is %s)" % (message, SHAPE))


def _addresses(spec: dict, key: str, required: bool) -> list:
    value = spec.get(key, [])
    if not isinstance(value, list) or (required and not value):
        raise _bad("%r must be a list of addresses%s, got %s"
                   % (key, " with at least one" if required else "", json.dumps(value)[:80]))
    if len(value) > MAX_ADDRESSES:
        raise _bad("%r holds %d addresses, more than %d" % (key, len(value), MAX_ADDRESSES))
    out = []
    for item in value:
        if not isinstance(item, str) or not item or len(item) > 64:
            raise _bad("%r must hold addresses as text, got %s" % (key, json.dumps(item)[:80]))
        try:
            network = ipaddress.ip_network(item, strict=True)
        except ValueError:
            raise _bad("%r holds %s, which is neither an IP address nor a network such as 10.0.0.0/24"
                       % (key, json.dumps(item)[:80])) from None
        if network.is_unspecified or (network.prefixlen == 0):
            raise _bad("%r holds %s, which would let in every address" % (key, item))
        out.append(network)
    return out


def _port(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise _bad("%s must be a TCP port from 1 to 65535, got %s" % (what, json.dumps(value)[:80]))
    return value


def _port_range(value, what: str) -> tuple:
    if not isinstance(value, list) or len(value) != 2:
        raise _bad("%s must be [LOW, HIGH], got %s" % (what, json.dumps(value)[:80]))
    low, high = _port(value[0], what), _port(value[1], what)
    if low > high:
        raise _bad("%s runs from %d down to %d: give [LOW, HIGH]" % (what, low, high))
    return low, high


def ray_ports(gcs: int) -> list:
    """Every port of Ray's (ranges ``(low, high)``), the cluster's GCS port with them."""
    return merge_ranges([(p, p) for p in (*ports.RAY_SINGLE, *ports.HEAD_METRICS, gcs)] + list(ports.RAY_RANGES))


def merge_ranges(ranges: list) -> list:
    """``(low, high)`` ranges sorted, overlapping and adjacent ones made one (nft refuses overlaps)."""
    merged = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(high, merged[-1][1]))
        else:
            merged.append((low, high))
    return merged


def _overlap(a: list, b: list) -> tuple:
    for low, high in a:
        for other_low, other_high in b:
            if low <= other_high and other_low <= high:
                return max(low, other_low), min(high, other_high)
    return ()


def _text(ranges: list) -> str:
    return ", ".join(str(low) if low == high else "%d-%d" % (low, high) for low, high in ranges)


def parse_spec(raw) -> dict:
    """Check a ``firewall write`` spec (bytes or a dict); a normalised dict, or ``bad_input`` naming the part."""
    if isinstance(raw, (bytes, str)):
        try:
            spec = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad("not JSON (%s)" % exc) from None
    else:
        spec = raw
    if not isinstance(spec, dict):
        raise _bad("it must be one JSON object")
    unknown = sorted(set(spec) - {"members", "console", "gateway", "ports"})
    if unknown:
        raise _bad("unknown key(s) %s" % ", ".join(map(repr, unknown)))
    given = spec.get("ports")
    if not isinstance(given, dict) or sorted(given) != ["copies", "files", "gcs"]:
        raise _bad("'ports' must be {\"gcs\", \"copies\", \"files\"}, got %s" % json.dumps(given)[:120])
    port_sets = {"ray": ray_ports(_port(given["gcs"], "ports.gcs")),
                 "copies": [_port_range(given["copies"], "ports.copies")],
                 "files": [(_port(given["files"], "ports.files"),) * 2]}
    names = {"ray": "Ray's ports", "copies": "the copies' ports", "files": "the file server's port"}
    for first, second in (("ray", "copies"), ("ray", "files"), ("copies", "files")):
        both = _overlap(port_sets[first], port_sets[second])
        if both:
            raise _bad("%s (%s) and %s (%s) share %s" % (names[first], _text(port_sets[first]), names[second],
                                                           _text(port_sets[second]), _text([both])))
    members = _addresses(spec, "members", required=True)
    console = _addresses(spec, "console", required=False)
    gateway = _addresses(spec, "gateway", required=False)
    return {"ports": port_sets,
            "from": {"ray": members, "copies": members + console + gateway, "files": members + console},
            "members": members, "console": console, "gateway": gateway}


# ------------------------------------------------------------------ the ruleset


def _elements(networks: list, version: int) -> list:
    chosen = [n for n in networks if n.version == version]
    return [str(n.network_address) if n.num_addresses == 1 else str(n)
            for n in ipaddress.collapse_addresses(chosen)] if chosen else []


def _set(name: str, kind: str, elements: list) -> list:
    lines = ["\tset %s {" % name, "\t\ttype %s" % kind, "\t\tflags interval"]
    if elements:
        lines.append("\t\telements = { %s }" % ", ".join(elements))
    return lines + ["\t}"]


def table_text(cluster: str, spec: dict) -> str:
    """The table's definition as ``nft`` reads it (``parse_spec``'s dict), without the delete around it."""
    table = table_name(cluster)
    lines = ["table %s %s {" % (FAMILY, table)]
    for kind in ("ray", "copies", "files"):
        lines += _set("%s_from_v4" % kind, "ipv4_addr", _elements(spec["from"][kind], 4))
        lines += _set("%s_from_v6" % kind, "ipv6_addr", _elements(spec["from"][kind], 6))
    lines += ["\tchain input {",
              "\t\ttype filter hook input priority filter; policy accept;",
              "\t\tiifname \"lo\" accept",
              "\t\tct state established,related accept"]
    for kind in ("ray", "copies", "files"):
        match = "meta l4proto { tcp, udp } th dport { %s }" % _text(spec["ports"][kind])
        lines += ["\t\t%s ip saddr @%s_from_v4 accept" % (match, kind),
                  "\t\t%s ip6 saddr @%s_from_v6 accept" % (match, kind),
                  "\t\t%s drop" % match]
    return "\n".join(lines + ["\t}", "}"]) + "\n"


def replace_text(cluster: str, spec: dict, others: list = ()) -> str:
    """The whole transaction ``nft -f -`` reads: the table (and any other cluster's, ``others``) deleted and
    the table made again. ``table X`` first makes the delete harmless when there is none yet."""
    lines = ["# Fadenstack: the firewall of cluster %s (firewall write); replaced whole, never edited." % cluster]
    for table in [table_name(cluster), *others]:
        lines += ["table %s %s" % (FAMILY, table), "delete table %s %s" % (FAMILY, table)]
    return "\n".join(lines) + "\n" + table_text(cluster, spec)


def remove_text(tables: list) -> str:
    lines = []
    for table in tables:
        lines += ["table %s %s" % (FAMILY, table), "delete table %s %s" % (FAMILY, table)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ nft


def nft_path() -> str:
    found = shutil.which("nft") or next((p for p in NFT_PLACES if os.access(p, os.X_OK)), None)
    if not found:
        raise AgentError(NOT_RETRYABLE, "nft is not installed on this machine: install the nftables package "
                                        "(the cluster's firewall is an nftables table)")
    return found


def nft(args: list, stdin: str = "") -> str:
    """Run ``nft`` with ``args`` (a list, no shell) and ``stdin``; its output, or its own words as the error."""
    try:
        done = subprocess.run([nft_path(), *args], input=stdin.encode(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=NFT_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AgentError(RETRYABLE, "nft did not answer within %d s" % NFT_TIMEOUT) from None
    if done.returncode != 0:
        words = " ".join(done.stderr.decode("utf-8", "replace").split())[:600] or "exit status %d" % done.returncode
        lasting = ("Operation not permitted", "not supported", "No such file")  # no root, no nf_tables: no retry helps
        kind = NOT_RETRYABLE if any(w in words for w in lasting) else RETRYABLE
        raise AgentError(kind, "nft refused: %s" % words)
    return done.stdout.decode("utf-8", "replace")


def owned_tables() -> list:
    """Every table of the agent's on this machine (``fadenstack_*`` in the inet family)."""
    found = []
    for line in nft(["list", "tables", FAMILY]).splitlines():
        words = line.split()
        if len(words) == 3 and words[0] == "table" and words[1] == FAMILY and words[2].startswith(TABLE_PREFIX):
            found.append(words[2])
    return found


def _listing(table: str) -> str:
    return nft(["list", "table", FAMILY, table])


# ------------------------------------------------------------------ the commands

CLUSTER = arg("--cluster", required=True, type=str, metavar="NAME", help="the cluster's name")


@command("firewall", "write", args=[CLUSTER])
def cmd_write(args, out) -> int:
    """``firewall write --cluster C`` with the spec on stdin: replace the cluster's nftables table whole.

    Stdin: ``{"members": [ADDRESS...], "console": [ADDRESS...], "gateway": [ADDRESS...], "ports":
    {"gcs", "copies": [LOW, HIGH], "files"}}`` (addresses or networks).  Ray's ports accept the members,
    the copies' ports the members, the console and the gateway, the file server's port the members and
    the console; loopback and established traffic always; the rest on those ports is dropped, other ports
    are untouched.  Another cluster's table left on the machine goes in the same transaction.  A bad
    part is ``bad_input``; no nft is ``not_retryable``.  Result: ``{"cluster", "table", "replaced",
    "ports": {"ray", "copies", "files"}, "allowed": {"ray", "copies", "files"}}`` (the ports as text,
    the addresses each lets in).
    """
    cluster = cluster_name(args.cluster)
    try:
        raw = read_spec(noun="firewall")
    except AgentError as exc:
        raise AgentError(exc.kind, "no firewall spec arrived on stdin: send one JSON object %s" % SHAPE) from None
    spec = parse_spec(raw)
    table = table_name(cluster)
    others = [t for t in owned_tables() if t != table]
    nft(["-f", "-"], replace_text(cluster, spec, others))
    return out.result(cluster=cluster, table="%s %s" % (FAMILY, table), replaced=others,
                      ports={k: _text(v) for k, v in spec["ports"].items()},
                      allowed={k: _elements(v, 4) + _elements(v, 6) for k, v in spec["from"].items()})


@command("firewall", "remove", args=[CLUSTER])
def cmd_remove(args, out) -> int:
    """``firewall remove --cluster C``: delete the cluster's nftables table (the machine left, or the cluster went).

    Removing a table that is not there is harmless.  Result: ``{"cluster", "table", "removed"}``.
    """
    cluster = cluster_name(args.cluster)
    table = table_name(cluster)
    present = table in owned_tables()
    if present:
        nft(["-f", "-"], remove_text([table]))
    return out.result(cluster=cluster, table="%s %s" % (FAMILY, table), removed=present)


@command("firewall", "status", args=[CLUSTER])
def cmd_status(args, out) -> int:
    """``firewall status --cluster C``: whether the cluster's table is on this machine, and its rules.

    Result: ``{"cluster", "table", "present", "others", "ruleset"}`` (``ruleset``: ``nft list table``'s
    text, empty when absent; ``others``: the other clusters' tables of the agent's on the machine).
    """
    cluster = cluster_name(args.cluster)
    table = table_name(cluster)
    tables = owned_tables()
    present = table in tables
    return out.result(cluster=cluster, table="%s %s" % (FAMILY, table), present=present,
                      others=[t for t in tables if t != table], ruleset=_listing(table) if present else "")
