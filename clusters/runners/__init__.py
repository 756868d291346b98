"""The bodies of the jobs on clusters, by kind: ``RUNNERS[kind](ctx, cluster_id=...)``."""
from clusters import node_leave, steps
from clusters.runners.certificates import cluster_renew_run
from clusters.runners.start import cluster_add_run, cluster_rejoin_run, cluster_start_run
from clusters.runners.stop import cluster_delete_run, cluster_stop_run

RUNNERS = {
    steps.START.kind: cluster_start_run,
    steps.ADD.kind: cluster_add_run,
    steps.REJOIN.kind: cluster_rejoin_run,
    steps.STOP.kind: cluster_stop_run,
    steps.DELETE.kind: cluster_delete_run,
    steps.LEAVE.kind: node_leave.cluster_leave_run,
    steps.RENEW.kind: cluster_renew_run,
}
