"""Signing a certificate for a person who asks: the request rules, a serial that never repeats, a record.

``certificate_issue`` is what the API, ``faden ssh`` and the pages call (once they are wired):
it asks the rules (machines/ssh_rules.py: who may, which key), takes the next serial by writing
the certificate's row (its id), has the authority sign (machines/ssh_ca.py), and records what was
signed, for whom and until when. The private key stays in ssh_ca; this module never sees it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography.hazmat.primitives.serialization import load_ssh_public_identity
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from console import roles
from console.pruning import delete_in_batches
from machines import ssh_ca, ssh_rules
from machines.models import SSHCertificate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Issued:
    certificate: str  # the OpenSSH certificate line, to save beside the key as <key>-cert.pub
    serial: int
    key_id: str
    principals: tuple[str, ...]
    valid_after: datetime
    valid_before: datetime


def certificate_issue(*, user, public_key: str, cluster: str, principals: Sequence[str],
                      valid_seconds: int | None = None, on_signed: Callable[[SSHCertificate], object] | None = None) -> Issued:
    """Sign a certificate for ``user``'s ``public_key`` that opens ``principals`` (the logins of
    ``cluster``'s nodes, machines/sshd.py), valid for ``FADEN_SSH_CERT_SECONDS`` (or less when
    ``valid_seconds`` says so). Refused with the rules' sentence: PermissionDenied for the person,
    ValidationError for the key or the principals.

    The serial is the row's id; the row is written and the certificate signed in one durable
    transaction, so a certificate is handed out only once its serial is committed and can never
    be drawn again (SQLite would draw a rolled-back id again). ``on_signed`` is called with the row in that
    transaction (the cluster records the certificate as one of its node logins: clusters/node_logins.py), so
    no certificate leaves unrecorded."""
    ssh_rules.certificate_request_offer(
        role=roles.acting(user), node_logins_allowed=roles.node_logins_allowed(user),
        public_key=public_key, ca_fingerprint=ssh_ca.ca_fingerprint(),
    ).check()
    if problem := ssh_rules.principals_problem(list(principals)):
        raise ValidationError(problem)
    parsed = ssh_rules.public_key_parse(public_key)
    seconds = min(valid_seconds or settings.FADEN_SSH_CERT_SECONDS, settings.FADEN_SSH_CERT_SECONDS)
    username = user.get_username()
    with transaction.atomic(durable=True):
        row = SSHCertificate.objects.create(user=user, username=username, public_key_fingerprint=parsed.fingerprint,
                                            principals=list(principals))
        key_id = ssh_ca.key_id_for(username=username, cluster=cluster, serial=row.pk)
        line = ssh_ca.certificate_for(parsed.line, principals=principals, key_id=key_id, valid_seconds=seconds, serial=row.pk)
        signed = load_ssh_public_identity(line.encode("ascii"))
        row.key_id = key_id
        row.valid_after = datetime.fromtimestamp(signed.valid_after, UTC)
        row.valid_before = datetime.fromtimestamp(signed.valid_before, UTC)
        row.save(update_fields=["key_id", "valid_after", "valid_before"])
        if on_signed is not None:
            on_signed(row)
    log.info("Signed the SSH certificate %s for the key %s of %s: principals %s, valid until %s.",
             key_id, parsed.fingerprint, username, ", ".join(principals), row.valid_before.isoformat())
    return Issued(certificate=line, serial=row.pk, key_id=key_id, principals=tuple(principals),
                  valid_after=row.valid_after, valid_before=row.valid_before)


def certificates_prune(older_than: datetime) -> int:
    """The records of certificates signed before ``older_than`` (each expired a day later at most);
    their serials are never drawn again all the same."""
    return delete_in_batches(SSHCertificate.objects.filter(signed_at__lt=older_than - timedelta(days=1)))
