"""The agents' TLS listener's ASGI application (``faden serve`` runs it under uvicorn on FADEN_AGENT_TLS_PORT,
with the certificate agents pin: console/agent_tls.py).

The console's own views, but only the machines' endpoints (/agent/...): a page, the API or the admin are not
served on this port, whoever asks.
"""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

AGENT_PREFIX = "/agent/"
NOT_HERE = b'{"error": "Only the machines\' endpoints (/agent/) are served on this port."}'


class AgentsOnly:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not scope["path"].startswith(AGENT_PREFIX):
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(NOT_HERE)).encode())]})
            await send({"type": "http.response.body", "body": NOT_HERE})
            return
        if scope["type"] != "http":  # no lifespan (uvicorn runs it with --lifespan off) and no websocket
            return
        await self.app(scope, receive, send)


application = AgentsOnly(get_asgi_application())
