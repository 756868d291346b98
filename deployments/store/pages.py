"""What the Models pages show, for a request or a websocket push, for the viewer's role."""
from __future__ import annotations

from django.template.loader import render_to_string

from console import roles
from deployments.models import StoredModel
from deployments.store import actions, selectors


def models_page(role: roles.Role | None) -> dict:
    return {"models": list(selectors.models_list()), "add": actions.ADD.offer(role), "role": role}


def model_page(model: StoredModel, role: roles.Role | None) -> dict:
    facts = model.facts or {}
    return {
        "model": model,
        "files": list(model.files.all()),
        "where": selectors.model_where(model),
        "jobs": selectors.model_jobs(model),
        "job": selectors.model_active_job(model),
        "targets": selectors.copy_targets(),
        "actions": actions.model_actions(model, role=role),
        "facts": facts,
        "role": role,
    }


def render_models_topic(arg: str, part: str, role: roles.Role) -> list[str]:
    return [render_to_string("deployments/model_list.html#rows", models_page(role) | {"oob": True})]


def render_model_topic(arg: str, part: str, role: roles.Role) -> list[str]:
    model = StoredModel.objects.filter(pk=int(arg)).first()
    if model is None:
        return [render_to_string("deployments/model_detail.html#deleted", {"oob": True})]
    return [render_to_string("deployments/model_detail.html#live", model_page(model, role) | {"oob": True})]
