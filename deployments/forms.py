"""Deploy a model, as the form and the API send it: read into a ``DeployAsk``; what the services refuse is
theirs to say. Here only what cannot even be read (a number that is not one, a cluster that does not
exist) is refused, field by field, in words."""
from __future__ import annotations

from django.core.exceptions import ValidationError

from clusters.models import Cluster
from deployments import engine
from deployments.choices import Routing, routing_refusal
from deployments.models import StoredModel
from deployments.asks import DeployAsk

GPU_CHOICES = ((1, "A quarter of a GPU"), (2, "Half a GPU"), (4, "1 GPU"), (8, "2 GPUs"), (16, "4 GPUs"), (32, "8 GPUs"),
               (64, "16 GPUs"), (128, "32 GPUs"))
GIB_IN_MIB = 1024


def kind_value(vendor: str, model: str, memory_mib: int, arch: str) -> str:
    """A GPU kind and architecture as one form value: ``nvidia|NVIDIA H100 80GB HBM3|81559|x86_64``."""
    return f"{vendor}|{model}|{memory_mib}|{arch}"


def _whole(data, field: str, what: str, errors: dict, *, default: int | None = None) -> int:
    raw = data.get(field)
    if raw in (None, "") and default is not None:
        return default
    try:
        return int(str(raw).strip())
    except (TypeError, ValueError):
        errors[field] = f"{what} must be a whole number, not {str(raw)[:40]!r}."
        return 0


def ask_from(data, *, cluster: Cluster | None = None, model: StoredModel | None = None) -> DeployAsk:
    """The ask the form (or a JSON body) describes; ValidationError by field for what cannot be read."""
    errors: dict[str, str] = {}
    if cluster is None:
        cluster = Cluster.objects.filter(pk=_whole(data, "cluster", "The cluster", errors, default=0)).first()
        if cluster is None:
            errors.setdefault("cluster", "Pick a cluster.")
    if model is None:
        model = StoredModel.objects.filter(pk=_whole(data, "model", "The model", errors, default=0)).first()
        if model is None:
            errors.setdefault("model", "Pick a model from the server's store.")
    try:
        vendor, gpu_model, memory_mib, arch = str(data.get("kind") or "").split("|")
        memory_mib = int(memory_mib)
    except ValueError:
        errors["kind"] = "Pick the kind of GPU the copies run on."
        vendor, gpu_model, memory_mib, arch = "", "", 0, ""
    memory = data.get("memory_per_gpu_gib")
    try:
        memory_per_gpu_mib = round(float(str(memory).strip()) * GIB_IN_MIB) if memory not in (None, "") else int(data.get("memory_per_gpu_mib"))
    except (TypeError, ValueError):
        errors["memory_per_gpu_mib"] = f"The GPU memory per GPU must be a number of GiB, not {str(memory)[:40]!r}."
        memory_per_gpu_mib = 0
    options = data.get("engine_options") or ""
    if not isinstance(options, (str, list, tuple)):
        errors["engine_options"] = "Engine options are text (one flag per word) or a list of flags."
    copies = _whole(data, "copies", "The number of copies", errors, default=1)
    gpu_quarters = _whole(data, "gpu_quarters", "The GPUs per copy", errors, default=4)
    context_length = _whole(data, "context_length", "The context length", errors, default=0)
    routing = data.get("routing") or Routing.LEAST_BUSY
    if refusal := routing_refusal(routing):
        errors["routing"] = refusal
    if errors:
        raise ValidationError(errors)
    return DeployAsk(
        cluster=cluster, model=model, name=str(data.get("name") or "").strip(), copies=copies, gpu_quarters=gpu_quarters,
        vendor=vendor, gpu_model=gpu_model, gpu_memory_mib=memory_mib, arch=arch, memory_per_gpu_mib=memory_per_gpu_mib,
        context_length=context_length, routing=routing,
        engine_options=tuple(engine.options_parse(options) if isinstance(options, str) else options))


CHANGE_FIELDS = ("kind", "gpu_quarters", "memory_per_gpu_gib", "context_length", "engine_options")


def gib_shown(memory_mib: int) -> float:
    """GPU memory as the forms show it: GiB to a tenth."""
    return round(memory_mib / GIB_IN_MIB, 1)


def change_ask_from(data, deployment) -> DeployAsk:
    """What a deployment's Change form asks: its fields over what the deployment has now (its name, copies and
    routing stay: Scale and Routing on its page change those). GPU memory left as the form showed it keeps the
    deployment's own MiB, so a form sent back as it came changes nothing."""
    fields = {field: data.get(field) for field in CHANGE_FIELDS}
    try:
        unchanged = float(str(fields["memory_per_gpu_gib"]).strip()) == gib_shown(deployment.memory_per_gpu_mib)
    except ValueError:
        unchanged = False
    if unchanged:
        fields |= {"memory_per_gpu_gib": None, "memory_per_gpu_mib": deployment.memory_per_gpu_mib}
    return ask_from(fields | {"name": deployment.name, "copies": deployment.copies, "routing": deployment.routing},
                    cluster=deployment.cluster, model=deployment.model)
