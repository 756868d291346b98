"""/api/machines/, composed where every app is known: the machines' own viewset with the actions the apps above
add to it (clusters: freeing what deleted clusters left on a machine; deployments: a machine's drain and Remove
from cluster). Machines import no app above them, so those are mixed in here, as /api/clusters/'s parts are in
config/cluster_api.py."""
from clusters.leftovers_api import MachineLeftoversActions
from deployments.drain_api import MachineDrainActions
from machines.api import MachineViewSet


class MachineApiViewSet(MachineDrainActions, MachineLeftoversActions, MachineViewSet):
    """Machines: list, read, delete; free what deleted clusters left on a machine; drain one, or remove it from its
    cluster."""
