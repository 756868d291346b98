from django.urls import path

from deployments.store import views

app_name = "models"

urlpatterns = [
    path("", views.model_list, name="list"),
    path("add/", views.model_add, name="add"),
    path("<int:pk>/", views.model_detail, name="detail"),
    path("<int:pk>/retry/", views.model_retry, name="retry"),
    path("<int:pk>/delete/", views.model_delete, name="delete"),
    path("<int:pk>/copy/", views.model_copy, name="copy"),
    path("<int:pk>/remove/", views.model_remove, name="remove"),
]
