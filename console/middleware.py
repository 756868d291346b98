from django.contrib.auth.middleware import LoginRequiredMiddleware


class LoginRequiredForPages(LoginRequiredMiddleware):
    """Every page needs a login. The API authenticates on its own (token or session, 401 as JSON),
    and machines authenticate their heartbeats with their own token."""

    open_prefixes = ("/api/", "/agent/")

    def process_view(self, request, view_func, view_args, view_kwargs):
        if request.path.startswith(self.open_prefixes):
            return None
        return super().process_view(request, view_func, view_args, view_kwargs)
