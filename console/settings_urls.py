"""The Settings page's addresses, under /settings/ (config/urls.py)."""
from django.urls import path

from console import settings_page

urlpatterns = [
    path("", settings_page.settings_page, name="settings"),
    path("hugging-face-token/", settings_page.hf_token_save, name="settings-hf-token"),
    path("hugging-face-token/remove/", settings_page.hf_token_remove, name="settings-hf-token-remove"),
]
