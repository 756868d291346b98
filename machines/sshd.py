"""What a machine's sshd reads to trust the console's certificate authority, as text. Pure: no I/O.

Three files go on each machine (the enrolment, or the next cluster start, puts them there, reloads
sshd and checks it with ``sshd -t``; docs/ssh-certificates.md):

- ``CA_PUBLIC_KEY_PATH``: the authority's public key (machines/ssh_ca.ca_public_key);
- ``DROPIN_PATH``: ``TrustedUserCAKeys`` naming it, and ``AuthorizedPrincipalsFile`` naming one
  file per account (``%u``);
- the file for root (``principals_file_for("root")``): the principals root accepts, one a line.

Why a file per account rather than one file: sshd reads a principals file without ``%u`` for
every account, so a certificate for a principal in it would open every account on the machine.
With ``%u``, an account without a file (every one but root) accepts no certificate at all.

A certificate names the principals it opens (machines/ssh_certificates.py), and they name one
cluster. Each machine of a cluster accepts the cluster's (``fadenstack-cluster-<id>``: a certificate
for every node, which stays within OpenSSH's 256 principals a certificate however large the cluster)
and its own within it (``fadenstack-cluster-<id>-machine-<id>``: a certificate for one node), nothing
else: a certificate for one cluster opens no node of another, nor a machine once it left.
"""
from __future__ import annotations

import re

from machines import ssh_rules

DROPIN_PATH = "/etc/ssh/sshd_config.d/fadenstack-ca.conf"
CA_PUBLIC_KEY_PATH = "/etc/fadenstack/ssh/ca.pub"
PRINCIPALS_FILE = "/etc/fadenstack/ssh/principals/%u"  # sshd puts the account's name for %u
REVOKED_KEYS_PATH = "/etc/fadenstack/ssh/revoked.krl"  # the cluster's key revocation list (machines/ssh_krl.py)
LOGIN_USER = "root"  # a node login is root's: the launchers, the hostfile and /shared are root's
# sshd_config takes a path as one word; quoting rules differ between versions, so a path needs none.
_PATH = re.compile(r"^/[A-Za-z0-9._/%-]+$")


def cluster_principal(cluster_id: int) -> str:
    """Every node of one cluster."""
    return f"fadenstack-cluster-{int(cluster_id)}"


def machine_principal(cluster_id: int, machine_id: int) -> str:
    """One machine, while it is that cluster's: a certificate for it opens nothing once it moves to another."""
    return f"fadenstack-cluster-{int(cluster_id)}-machine-{int(machine_id)}"


def root_principals(*, machine_id: int, cluster_id: int) -> list[str]:
    """The principals a machine of a cluster accepts for root: its cluster's, and its own within that cluster.
    Nothing else: a certificate is for one cluster only."""
    return [cluster_principal(cluster_id), machine_principal(cluster_id, machine_id)]


def login_principals(*, cluster_id: int, machine_ids: list[int] | None = None) -> list[str]:
    """The principals a certificate names: the cluster's (every node) or, for ``machine_ids``, those nodes'
    within the cluster."""
    return [machine_principal(cluster_id, m) for m in machine_ids] if machine_ids else [cluster_principal(cluster_id)]


def principals_file_for(user: str = LOGIN_USER, principals_file: str = PRINCIPALS_FILE) -> str:
    """The path sshd reads for ``user``'s principals: ``principals_file`` with ``%u`` put in."""
    return principals_file.replace("%u", user)


def principals_file_text(principals: list[str]) -> str:
    """The principals file's content: one principal a line."""
    if problem := ssh_rules.principals_problem(principals):
        raise ValueError(problem)
    return "".join(f"{principal}\n" for principal in principals)


def sshd_dropin(principals_file: str = PRINCIPALS_FILE, ca_public_key_path: str = CA_PUBLIC_KEY_PATH,
                revoked_keys_path: str | None = REVOKED_KEYS_PATH) -> str:
    """The drop-in for ``DROPIN_PATH``: trust the console's authority for certificates, and let each
    account accept only the principals in its own file.

    sshd takes the first value it reads for each keyword, and Debian, Ubuntu and Fedora include
    sshd_config.d/*.conf at the top of sshd_config: these win over the main file's. A machine
    whose sshd_config has no such Include must get one (the wiring checks with ``sshd -T``).

    ``RevokedKeys`` names the cluster's key revocation list, which must be on the machine before this
    drop-in is (sshd refuses every public key while it cannot read it): the node settings write both."""
    for path in (principals_file, ca_public_key_path, *([revoked_keys_path] if revoked_keys_path else [])):
        if not _PATH.match(path) or ".." in path.split("/"):
            raise ValueError(f"{path!r} is not an absolute path sshd reads as one word.")
    if "%u" not in principals_file:
        raise ValueError(f"{principals_file} names one file for every account: name it per account with %u.")
    return (
        "# Fadenstack: logins with a certificate signed by the console's SSH certificate authority.\n"
        "# Written by the console; changes here are overwritten.\n"
        f"TrustedUserCAKeys {ca_public_key_path}\n"
        f"AuthorizedPrincipalsFile {principals_file}\n"
        + (f"RevokedKeys {revoked_keys_path}\n" if revoked_keys_path else "")
    )
