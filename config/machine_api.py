"""/api/machines/, composed where every app is known: the machines' own viewset with the actions clusters add
to it (freeing what deleted clusters left on a machine). Machines import no app above them, so those are
mixed in here, as /api/clusters/'s parts are in config/cluster_api.py."""
from clusters.leftovers_api import MachineLeftoversActions
from machines.api import MachineViewSet


class MachineApiViewSet(MachineLeftoversActions, MachineViewSet):
    """Machines: list, read, delete; free what deleted clusters left on one."""
