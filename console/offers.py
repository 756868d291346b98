"""Whether a button may be pressed now, and when not, the sentence that says why.

An action's offer is worked out in one place (``clusters/actions.py``,
``machines/actions.py``): the page greys its button out with it, the service
refuses with it, and the API answers with it.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.core.exceptions import PermissionDenied, ValidationError


@dataclass(frozen=True)
class Offer:
    """A button's state: allowed, or not with the reason. ``forbidden``: the reason is the user's
    role (a 403), not the state of what the button acts on (a 400)."""

    ok: bool
    why: str = ""
    forbidden: bool = False

    def check(self) -> None:
        """Refuse unless allowed: PermissionDenied for a role that may not, else ValidationError."""
        if self.ok:
            return
        if self.forbidden:
            raise PermissionDenied(self.why)
        raise ValidationError(self.why)

    def then(self, other: Offer) -> Offer:
        """This refusal, or when allowed, ``other``: the role is asked first, then the state."""
        return other if self.ok else self


ALLOWED = Offer(True)
