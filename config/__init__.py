"""The project's wiring: settings, root urls, ASGI, the Celery app and the ``faden`` command.

The Celery app is loaded with the project so that every ``@shared_task`` binds to it.
"""
from config.celery import app as celery_app

__all__ = ["celery_app"]
