"""/api/clusters/, composed where every app is known: the clusters' own viewset with what each part adds to
it. Clusters import no app above them, so the parts that need one (the model source, the deployments)
cannot be mixed in there; all of them are mixed in here, in one list."""
from clusters.api import ClusterViewSet
from clusters.connection_api import ConnectionActions
from clusters.nccl_api import NcclTestActions
from deployments.api import DeploymentsField
from deployments.store.api import ModelSourceActions


class ClusterApiViewSet(DeploymentsField, ModelSourceActions, ConnectionActions, NcclTestActions, ClusterViewSet):
    """Clusters: create, start, stop, check, delete, change; their connection, NCCL tests, model source and
    deployments."""
