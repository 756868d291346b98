"""What a person asks of a deployment, as the form, the API, the plan and the apply job all read it."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from django.conf import settings

from clusters.models import Cluster
from deployments import placement, placement_input
from deployments.choices import Routing
from deployments.models import Deployment, StoredModel


@dataclass(frozen=True)
class DeployAsk:
    """What a person asks for in Deploy a model (the form, the API, the plan alike)."""

    cluster: Cluster
    model: StoredModel
    name: str
    copies: int
    gpu_quarters: int  # GPUs per copy in quarters of a GPU: 1, 2, 4, 8, 16, ...
    vendor: str
    gpu_model: str
    gpu_memory_mib: int
    arch: str
    memory_per_gpu_mib: int
    context_length: int
    engine_options: tuple[str, ...] = ()
    routing: str = Routing.LEAST_BUSY  # the gateway's choice of a copy: changed without replacing any

    @property
    def kind(self) -> placement.GpuKind:
        return placement_input.gpu_kind(self.vendor, self.gpu_model, self.gpu_memory_mib)

    def wanted(self, count: int, *, deployment_id: int = 0, first: int = 1) -> list[placement.CopyWanted]:
        return [placement.CopyWanted(key=f"c{first + i}", deployment=deployment_id, gpus=Fraction(self.gpu_quarters, 4),
                                     memory_per_gpu_bytes=self.memory_per_gpu_mib * placement_input.MIB, kind=self.kind, arch=self.arch)
                for i in range(count)]


def port_range() -> tuple[int, int]:
    return settings.FADEN_COPY_PORTS


def slot_json(slot: placement.Slot) -> dict:
    return {"machine": slot.machine_id, "gpus": list(slot.gpu_indices), "quarters": int(slot.share * 4), "port": slot.port}


def ask_of(deployment: Deployment, **changes) -> DeployAsk:
    fields = dict(cluster=deployment.cluster, model=deployment.model, name=deployment.name, copies=deployment.copies,
                  gpu_quarters=deployment.gpu_quarters, vendor=deployment.gpu_vendor, gpu_model=deployment.gpu_model,
                  gpu_memory_mib=deployment.gpu_memory_mib, arch=deployment.arch,
                  memory_per_gpu_mib=deployment.memory_per_gpu_mib, context_length=deployment.context_length,
                  engine_options=tuple(deployment.engine_options), routing=deployment.routing)
    return DeployAsk(**(fields | changes))
