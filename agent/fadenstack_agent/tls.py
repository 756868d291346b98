"""``tls request|install|status --cluster C``: the cluster's TLS keys and certificates on this machine.

Keys are made here and never leave this machine: ``tls request`` makes a key (ECDSA P-256) for each
role asked for and answers a certificate signing request for it, which the console's authority signs;
``tls install`` puts the certificates (and the authority's) beside their keys; ``tls status`` says
what is installed and until when. Files and paths: ``tlsfiles``. ``openssl`` (installed on every
Linux distribution's base system) makes the keys and reads the certificates: the agent uses only the
standard library, which has no key generation. No key ever goes through a command line: keys travel
to ``openssl`` on its stdin, and its answers come back on stdout.
"""

import calendar
import ipaddress
import json
import os
import shutil
import subprocess
import time

from .blobspec import read_spec
from .cli import arg, command, group
from .protocol import BAD_INPUT, NOT_RETRYABLE, AgentError
from .secretsdir import check_cluster, write_file
from .tlsfiles import CA, ROLES, open_dir, read_file, tls_dir

OPENSSL_TIMEOUT = 30
MAX_PEM = 64 * 1024
SHAPE = '{"ca": "-----BEGIN CERTIFICATE-----...", "certificates": {"node": "-----BEGIN CERTIFICATE-----...", "copy": ...}}'

group("tls", help="the cluster's TLS keys and certificates on this machine")
CLUSTER = arg("--cluster", required=True, metavar="NAME", help="the cluster's name")


def _openssl(args: list, stdin: bytes = b"") -> bytes:
    binary = shutil.which("openssl")
    if binary is None:
        raise AgentError(NOT_RETRYABLE, "openssl is not installed on this machine: install it (the agent makes "
                                        "the cluster's TLS keys with it)")
    try:
        done = subprocess.run([binary] + args, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=OPENSSL_TIMEOUT, cwd="/", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except subprocess.TimeoutExpired:
        raise AgentError(NOT_RETRYABLE, "openssl %s did not finish within %d s" % (args[0], OPENSSL_TIMEOUT))
    if done.returncode != 0:
        words = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise AgentError(BAD_INPUT if args[0] in ("x509", "verify") else NOT_RETRYABLE,
                         "openssl %s failed: %s" % (args[0], " ".join(words[-3:])[:400] or "exit %d" % done.returncode))
    return done.stdout


def parse_roles(text) -> list:
    roles = [r.strip() for r in str(text or "").split(",") if r.strip()]
    if not roles or any(r not in ROLES for r in roles) or len(set(roles)) != len(roles):
        raise AgentError(BAD_INPUT, "--role must be one or more of %s (comma-separated), got %r" % (", ".join(ROLES), text))
    return roles


def parse_address(text):
    if text is None:
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise AgentError(BAD_INPUT, "--address must be the machine's cluster address (an IP address), got %r" % (text,))


def make_request(dir_fd: int, role: str, address) -> str:
    """A new key for ``role`` (``<role>.key.new``, 0600) and its signing request (PEM)."""
    key = _openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"])
    write_file(dir_fd, role + ".key.new", key)
    subject = "/O=Fadenstack"
    extra = []
    if address is not None:
        subject += "/CN=%s" % address
        extra = ["-addext", "subjectAltName=IP:%s" % address]
    return _openssl(["req", "-new", "-key", "/dev/stdin", "-subj", subject] + extra, stdin=key).decode("ascii")


def describe(pem: bytes) -> dict:
    """``{"not_after": ISO 8601 UTC, "serial": hex}`` of the certificate in ``pem``."""
    lines = _openssl(["x509", "-noout", "-enddate", "-serial"], stdin=pem).decode("ascii", "replace").splitlines()
    fields = dict(line.split("=", 1) for line in lines if "=" in line)
    try:
        parsed = time.strptime(" ".join(fields["notAfter"].split()), "%b %d %H:%M:%S %Y GMT")
    except (KeyError, ValueError):
        raise AgentError(BAD_INPUT, "openssl gave no expiry for the certificate: %r" % lines[:2])
    return {"not_after": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(calendar.timegm(parsed))),
            "serial": fields.get("serial", "").lower().lstrip("0") or "0"}


def _pem(value, what: str) -> bytes:
    if not isinstance(value, str) or len(value) > MAX_PEM or not value.strip().startswith("-----BEGIN CERTIFICATE-----"):
        raise AgentError(BAD_INPUT, "%s is not a certificate in PEM: send %s" % (what, SHAPE))
    return value.strip().encode("ascii", "replace") + b"\n"


def parse_install(data: bytes) -> tuple:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise AgentError(BAD_INPUT, "send one JSON object on stdin: %s" % SHAPE)
    if not isinstance(value, dict) or not isinstance(value.get("certificates"), dict) or not value["certificates"]:
        raise AgentError(BAD_INPUT, "send one JSON object on stdin: %s" % SHAPE)
    unknown = sorted(set(value["certificates"]) - set(ROLES))
    if unknown:
        raise AgentError(BAD_INPUT, "unknown role(s) %s: the roles are %s" % (", ".join(map(repr, unknown))[:200], ", ".join(ROLES)))
    return _pem(value.get("ca"), "ca"), {role: _pem(pem, role) for role, pem in value["certificates"].items()}


def install(cluster: str, ca: bytes, certificates: dict) -> dict:
    """Check each certificate against the authority and against its key (the pending one from
    ``tls request``, else the installed one), then put them in place: the authority, then per role the
    certificate beside its key."""
    fd = open_dir(tls_dir(cluster))
    try:
        write_file(fd, ".ca.pem.check", ca)
        checking = os.path.join(tls_dir(cluster), ".ca.pem.check")
        chosen = {}
        for role, pem in certificates.items():
            _openssl(["verify", "-CAfile", checking, "-purpose", "sslserver"], stdin=pem)
            public = _openssl(["x509", "-noout", "-pubkey"], stdin=pem)
            for name in (role + ".key.new", role + ".key"):
                key = read_file(fd, name)
                if key is not None and _openssl(["pkey", "-pubout"], stdin=key) == public:
                    chosen[role] = name
                    break
            else:
                raise AgentError(BAD_INPUT, "the %s certificate is not for a key of this machine's: run `tls request "
                                            "--cluster %s --role %s` and send the certificate signed for it" % (role, cluster, role))
        os.rename(".ca.pem.check", CA, src_dir_fd=fd, dst_dir_fd=fd)
        answer = {}
        for role, pem in certificates.items():
            write_file(fd, role + ".pem.new", pem)
            if chosen[role] != role + ".key":
                os.rename(chosen[role], role + ".key", src_dir_fd=fd, dst_dir_fd=fd)
            os.rename(role + ".pem.new", role + ".pem", src_dir_fd=fd, dst_dir_fd=fd)
            answer[role] = describe(pem)
        os.fsync(fd)
        return answer
    finally:
        try:
            os.unlink(".ca.pem.check", dir_fd=fd)
        except FileNotFoundError:
            pass
        os.close(fd)


def status(cluster: str) -> dict:
    try:
        fd = open_dir(tls_dir(cluster))
    except AgentError:
        return {"ca": None, "certificates": {}, "pending": []}
    try:
        ca = read_file(fd, CA)
        certificates = {}
        for role in ROLES:
            pem = read_file(fd, role + ".pem")
            if pem is not None and read_file(fd, role + ".key") is not None:
                certificates[role] = describe(pem)
        pending = [role for role in ROLES if read_file(fd, role + ".key.new") is not None]
        return {"ca": describe(ca) if ca else None, "certificates": certificates, "pending": pending}
    finally:
        os.close(fd)


# ------------------------------------------------------------------ commands


@command("tls", "request", args=[CLUSTER,
                                 arg("--role", required=True, metavar="ROLE[,ROLE]", help="node (Ray), copy (a copy's server), or both"),
                                 arg("--address", metavar="IP", help="the machine's cluster address, named in the request")])
def cmd_request(args, out):
    """``tls request --cluster C --role node[,copy] [--address IP]``: make a key for each role on this
    machine (``/etc/fadenstack/clusters/C/tls/<role>.key.new``, 0600; it never leaves the machine) and
    answer a certificate signing request for it.

    Result: ``{"cluster", "requests": {"node": "-----BEGIN CERTIFICATE REQUEST-----...", ...}}``. The
    key in use stays until ``tls install`` brings its successor's certificate."""
    cluster = check_cluster(args.cluster)
    roles = parse_roles(args.role)
    address = parse_address(args.address)
    fd = open_dir(tls_dir(cluster), create=True)
    try:
        requests = {role: make_request(fd, role, address) for role in roles}
        os.fsync(fd)
    finally:
        os.close(fd)
    return out.result(cluster=cluster, requests=requests)


@command("tls", "install", args=[CLUSTER])
def cmd_install(args, out):
    """``tls install --cluster C``: install the certificates sent on stdin as ``{"ca": PEM,
    "certificates": {"node": PEM, "copy": PEM}}`` beside the keys ``tls request`` made.

    Each must be signed by ``ca`` and be for this machine's key (else ``bad_input``, nothing changed).
    Result: ``{"cluster", "installed": {"node": {"not_after", "serial"}, ...}}``. Ray and the copies
    read their files when they start: what runs keeps its certificate until then."""
    cluster = check_cluster(args.cluster)
    try:
        data = read_spec(noun="certificates")
    except AgentError as exc:
        raise AgentError(exc.kind, "no certificates arrived on stdin: send %s" % SHAPE)
    ca, certificates = parse_install(data)
    return out.result(cluster=cluster, installed=install(cluster, ca, certificates))


@command("tls", "status", args=[CLUSTER])
def cmd_status(args, out):
    """``tls status --cluster C``: what is installed for the cluster on this machine.

    Result: ``{"cluster", "ca": {"not_after", "serial"} | null, "certificates": {"node": {"not_after",
    "serial"}, ...}, "pending": [roles with a key made but no certificate yet]}``."""
    cluster = check_cluster(args.cluster)
    return out.result(cluster=cluster, **status(cluster))
