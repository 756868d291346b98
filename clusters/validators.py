"""What a cluster's name may look like: the rules the wizard, the API and the admin share."""
import re

from django.core.exceptions import ValidationError

_NAME_CHARS = re.compile(r"[a-z0-9-]+")


def validate_cluster_name(name: str) -> None:
    """DNS-label rules, each refusal naming the rule it broke (uniqueness is the database's)."""
    if not name:
        raise ValidationError("Enter a cluster name.", code="required")
    if len(name) > 63:
        raise ValidationError(f"A cluster name is at most 63 characters; this one has {len(name)}.", code="too_long")
    if not _NAME_CHARS.fullmatch(name):
        raise ValidationError("A cluster name uses only lowercase letters, digits and hyphens (like gpu-room).", code="invalid_name")
    if name[0] == "-" or name[-1] == "-":
        raise ValidationError("A cluster name starts and ends with a letter or a digit.", code="invalid_name")


def name_taken(name: str) -> str:
    """The refusal of a name another cluster has (the wizard's pre-check, a race, the admin)."""
    return f"There is already a cluster named {name}; pick another name."
