"""Your profile's addresses, under /profile/ (config/urls.py)."""
from django.urls import path

from machines import profile_views

urlpatterns = [
    path("keys/", profile_views.profile_keys, name="profile-keys"),
    path("keys/add/", profile_views.profile_key_add, name="profile-key-add"),
    path("keys/<id:pk>/remove/", profile_views.profile_key_remove, name="profile-key-remove"),
]
