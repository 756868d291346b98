"""Who may call the REST API (DEFAULT_PERMISSION_CLASSES). A module of its own: DRF imports it while
its views module loads, so it imports nothing that imports DRF's views."""
from rest_framework import permissions

from console import roles


class HasRole(permissions.BasePermission):
    """Every role reads the whole API; an account without a role gets a 403 that says so. What a role
    may change is checked by the services, next to each action's other preconditions, and refused
    with a 403 and the sentence that says which role it needs."""

    message = roles.NO_ROLE

    def has_permission(self, request, view) -> bool:
        return roles.role_of(request.user) is not None
