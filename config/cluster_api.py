"""/api/clusters/, composed where every app is known: the clusters' own viewset with what each part adds to
it. Clusters import no app above them, so the parts that need one (the model source, the deployments)
cannot be mixed in there; all of them are mixed in here, in one list."""
from clusters.api import ClusterViewSet
from clusters.connection_api import ConnectionActions
from clusters.encryption_actions import EncryptionActions
from clusters.nccl_api import NcclTestActions
from clusters.node_logins_api import NodeLoginActions
from deployments.api import DeploymentsField
from deployments.orphans_api import OrphanActions
from deployments.store.api import ModelSourceActions
from deployments.tls_api import ModelTrafficActions


class ClusterApiViewSet(DeploymentsField, ModelSourceActions, ConnectionActions, NcclTestActions, NodeLoginActions,
                        EncryptionActions, ModelTrafficActions, OrphanActions, ClusterViewSet):
    """Clusters: create, start, stop, check, delete, change; their connection, NCCL tests, model source,
    deployments and the models running without one."""
