from django.contrib.auth.middleware import LoginRequiredMiddleware
from django.contrib.auth.views import LogoutView
from django.core.exceptions import PermissionDenied
from django.utils.deprecation import MiddlewareMixin

from console import roles

# The API authenticates on its own (token or session, 401 as JSON) and checks roles itself
# (console.api.HasRole); machines authenticate their heartbeats with their own token.
OPEN_PREFIXES = ("/api/", "/agent/")


class LoginRequiredForPages(LoginRequiredMiddleware):
    """Every page needs a login."""

    def process_view(self, request, view_func, view_args, view_kwargs):
        if request.path.startswith(OPEN_PREFIXES):
            return None
        return super().process_view(request, view_func, view_args, view_kwargs)


class RoleRequiredForPages(MiddlewareMixin):
    """Every page needs a role: an account without one gets the page that says so (a 403), and can
    still sign out. What each role may change is checked by the actions themselves."""

    def process_view(self, request, view_func, view_args, view_kwargs):
        if request.path.startswith(OPEN_PREFIXES) or not getattr(view_func, "login_required", True):
            return None
        if getattr(view_func, "view_class", None) is LogoutView or not request.user.is_authenticated:
            return None
        if roles.role_of(request.user) is None:
            raise PermissionDenied(roles.NO_ROLE)
        return None
