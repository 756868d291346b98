"""The Django admin, for Administrators only.

It writes records without going through the services' jobs, so only the role that may do everything
uses it; Viewers and Operators read the same records on the console's pages and in the API. Even
an Administrator changes there only what the services would let them, validated by the same rules
(the apps' admin.py: what only the console writes is read-only). Which models they see is model
permissions, which the Administrator group holds in full (console/roles.py).
"""
from django.contrib.admin import AdminSite
from django.contrib.admin.apps import AdminConfig
from django.contrib.auth import REDIRECT_FIELD_NAME
from django.contrib.auth.decorators import login_not_required
from django.core.exceptions import PermissionDenied
from django.urls import reverse
from django.utils.decorators import method_decorator
from django.views.decorators.cache import never_cache

from console import roles

USE_ADMIN = roles.Action("using the Django admin", roles.ADMINISTRATOR)


class ConsoleAdminSite(AdminSite):
    site_header = "Fadenstack admin"
    site_title = "Fadenstack admin"

    def has_permission(self, request) -> bool:
        return USE_ADMIN.offer(roles.role_of(request.user)).ok

    @method_decorator(never_cache)
    @login_not_required
    def login(self, request, extra_context=None):
        """The admin has no sign-in of its own: the console's is the one throttled and audited
        (console/logins.py), and it comes back here after. Someone signed in without the role gets the
        sentence that says why, not a second login form."""
        from django.contrib.auth.views import redirect_to_login  # loads auth's models: not at app loading

        if not request.user.is_authenticated:
            return redirect_to_login(request.GET.get(REDIRECT_FIELD_NAME) or reverse("admin:index", current_app=self.name))
        if not self.has_permission(request):
            raise PermissionDenied(USE_ADMIN.offer(roles.role_of(request.user)).why)
        return super().login(request, extra_context)


class ConsoleAdminConfig(AdminConfig):
    """django.contrib.admin, on the site above (INSTALLED_APPS names this in its place)."""

    default_site = "console.admin_site.ConsoleAdminSite"
