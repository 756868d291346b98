"""What a machine's name, address, SSH user, port and host key may look like.

These run before anything reaches SSH, in the model (so forms, the API and
services share them). Each refusal says which rule was broken.
"""
import ipaddress
import re

from django.core.exceptions import ValidationError

MAX_INPUT = 255

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_HOST_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_SSH_USER = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")
_FINGERPRINT = re.compile(r"^SHA256:[A-Za-z0-9+/]{43}$")


def _article(what: str) -> str:
    return "an" if what[0] in "aeiou" else "a"


def _check_length(value: str, what: str, limit: int = MAX_INPUT) -> None:
    if not value:
        raise ValidationError(f"Enter {_article(what)} {what}.", code="required")
    if len(value) > limit:
        raise ValidationError(
            f"{_article(what).capitalize()} {what} is at most {limit} characters; this one has {len(value)}.",
            code="too_long",
        )


def validate_machine_name(value: str) -> None:
    _check_length(value, "machine name", 63)
    if not _DNS_LABEL.fullmatch(value):
        raise ValidationError(
            "A machine name uses lowercase letters, digits and hyphens, and starts and ends with a letter or digit "
            "(like gpu-01).",
            code="invalid_name",
        )


def validate_address(value: str) -> None:
    """An IPv4/IPv6 address or a DNS host name: nothing that a shell or ssh could read as more."""
    _check_length(value, "address", 253)
    try:
        # A scope id (fe80::1%eth0) is refused: it would carry arbitrary text to ssh.
        if "%" not in value:
            ipaddress.ip_address(value)
            return
    except ValueError:
        pass
    labels = value.rstrip(".").split(".")
    if not all(_HOST_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise ValidationError(
            "Enter an IP address (198.18.0.11, fd00::11) or a host name (gpu-01.example.com); "
            "letters, digits, hyphens and dots only.",
            code="invalid_address",
        )


def validate_ssh_user(value: str) -> None:
    _check_length(value, "user name", 32)
    if not _SSH_USER.fullmatch(value):
        raise ValidationError(
            "A user name starts with a lowercase letter or underscore and has only lowercase letters, digits, "
            "dots, underscores and hyphens (like root or ubuntu).",
            code="invalid_user",
        )


def validate_ssh_port(value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ValidationError(f"An SSH port is a number from 1 to 65535, not {value!r}.", code="invalid_port")


def validate_fingerprint(value: str) -> None:
    _check_length(value, "host key fingerprint", 100)
    if not _FINGERPRINT.fullmatch(value):
        raise ValidationError(
            "A host key fingerprint looks like SHA256: followed by 43 characters "
            "(what ssh-keygen -lf prints for the machine's host key).",
            code="invalid_fingerprint",
        )
