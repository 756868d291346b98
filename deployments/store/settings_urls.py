"""The Settings page's addresses, under /settings/ (config/urls.py)."""
from django.urls import path

from deployments.store import hub_token_views

urlpatterns = [
    path("", hub_token_views.settings_page, name="settings"),
    path("hugging-face-token/", hub_token_views.hf_token_save, name="settings-hf-token"),
    path("hugging-face-token/remove/", hub_token_views.hf_token_remove, name="settings-hf-token-remove"),
]
