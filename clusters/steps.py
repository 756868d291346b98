"""Every operation on a cluster, as a job kind and its steps, defined once (``console.jobs``'s
``Step`` and ``Operation``).

The service names the steps up front (the job's card shows them all before
they run); the runner begins each one through the same object, and a job taken
up again after its worker died skips the steps an earlier run finished. Both
sides use these objects, so a step cannot be renamed on one side only.
"""
from __future__ import annotations

from console.jobs import Operation, Step

STOP_RAY = Step("Stop Ray on every machine")
GET_IMAGE = Step("Get the runtime image")
LOAD_IMAGE = Step("Load the image")
START_HEAD = Step("Start Ray on the head")
JOIN_OTHERS = Step("Join the other machines")
CHECK_RAY = Step("Check with Ray")
REACH_HEAD = Step("Check the way to the head")
JOIN_RAY = Step("Join Ray")
TAKE_OUT = Step("Take it out of Ray")
START_RUNTIME = Step("Start its runtime")
STOP_ALL = Step("Stop Ray and the runtime")
# The hostfile, cluster.env, /etc/hosts lines, node-to-node SSH and sshd's trust (clusters/runners/nodes.py).
WRITE_SETTINGS = Step("Write the node settings")
REMOVE_SETTINGS = Step("Remove the node settings")
# /shared on the head, mounted on every other node with NFS or sshfs (clusters/runners/shared.py).
SHARE_FILES = Step("Share /shared")
UNMOUNT_SHARED = Step("Unmount /shared")
DELETE_RECORD = Step("Delete the record")
# Ray's token (clusters/ray_token.py) on every member before Ray starts or joins there; gone at delete.
DELIVER_SECRETS = Step("Deliver the Ray token")
REMOVE_SECRETS = Step("Remove the cluster's secrets")
# The cluster's TLS certificates: keys made on each machine, signed by the console's authority (clusters/certificates.py).
ISSUE_CERTIFICATES = Step("Issue certificates")
RENEW_CERTIFICATES = Step("Renew certificates")
# The cluster's own nftables table on each machine (clusters/runners/firewall.py, docs/network.md).
CLOSE_FIREWALL = Step("Close the firewall")
OPEN_FIREWALL = Step("Open the firewall")

START = Operation("cluster.start", (CLOSE_FIREWALL, GET_IMAGE, LOAD_IMAGE, DELIVER_SECRETS, ISSUE_CERTIFICATES, START_HEAD,
                                    JOIN_OTHERS, CHECK_RAY, WRITE_SETTINGS, SHARE_FILES))
# A restart is a start that first stops Ray everywhere: the same kind, one step more.
RESTART = Operation(START.kind, (STOP_RAY, *START.steps))
# A join changes every node's hostfile and hosts: ADD and REJOIN write every member's settings again.
# ADD lets the newcomers in on every member first: they check the way to the head and fetch the image from them.
ADD = Operation("cluster.add", (CLOSE_FIREWALL, REACH_HEAD, GET_IMAGE, LOAD_IMAGE, DELIVER_SECRETS, ISSUE_CERTIFICATES,
                                JOIN_RAY, CHECK_RAY, WRITE_SETTINGS, SHARE_FILES))
REJOIN = Operation("cluster.rejoin", (TAKE_OUT, START_RUNTIME, DELIVER_SECRETS, ISSUE_CERTIFICATES, CLOSE_FIREWALL, JOIN_RAY,
                                      CHECK_RAY, WRITE_SETTINGS, SHARE_FILES))
STOP = Operation("cluster.stop", (STOP_ALL,))  # the settings stay: the cluster and its nodes do not change
# /shared is unmounted before the settings go: sshfs logs in with the cluster's own key.
DELETE = Operation("cluster.delete", (STOP_ALL, OPEN_FIREWALL, REMOVE_SECRETS, UNMOUNT_SHARED, REMOVE_SETTINGS, DELETE_RECORD))
# A machine left the record (Remove from cluster): its copy of the cluster's settings goes, and the others move
# to a new node key (clusters/node_leave.py). /shared is shared again: the NFS export lists the members left.
CLEAR_LEFT = Step("Clear the machine that left")
ROTATE_KEY = Step("Rotate the node key")
LEAVE = Operation("cluster.leave", (CLEAR_LEFT, ROTATE_KEY, SHARE_FILES))
PROBE_KIND = "cluster.probe"  # the network test: its steps are the networks it measures
# The NCCL test (clusters/runners/nccl.py): its job is the test's, not the cluster's, so it blocks no operation.
RUN_ALLREDUCE = Step("Run the all-reduce")
NCCL_TEST = Operation("cluster.nccl_test", (RUN_ALLREDUCE,))

# Renew certificates (a button, and the hourly beat): new keys and certificates on every machine; nothing restarts.
RENEW = Operation("cluster.renew_certificates", (RENEW_CERTIFICATES,))

# Stop and Delete win over these: they are asked to end at their next step.
CANCELLABLE_KINDS = frozenset({START.kind, ADD.kind, REJOIN.kind})
