"""The Celery app: every SSH job runs in a worker, periodic checks run from one beat."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("fadenstack")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
