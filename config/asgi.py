"""ASGI entry point: pages and the API over HTTP, live cards over one websocket."""
import os
from urllib.parse import urlsplit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from console.consumers import LiveConsumer  # noqa: E402


class SameOriginOnly:
    """Refuse websockets opened by pages of another origin (the browser sends Origin; we compare to Host)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", []))
        origin = headers.get(b"origin", b"").decode()
        host = headers.get(b"host", b"").decode()
        if not origin or urlsplit(origin).netloc != host:
            await receive()  # the websocket.connect message; closing now refuses the handshake
            await send({"type": "websocket.close", "code": 4403})
            return
        return await self.app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": SameOriginOnly(AuthMiddlewareStack(URLRouter([path("ws/live/", LiveConsumer.as_asgi())]))),
    }
)
