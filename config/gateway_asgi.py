"""The gateway's ASGI application (``faden serve`` runs it under uvicorn on FADEN_GATEWAY_PORT).

Not Django's request stack: Django is set up for the ORM the route table reads, and the application
is the gateway's own (deployments/gateway/app.py).
"""
import logging
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup()
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request otherwise

from deployments.gateway.app import Gateway  # noqa: E402  (after django.setup())

application = Gateway.from_settings()
