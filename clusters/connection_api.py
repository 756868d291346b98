"""REST for reaching a cluster: ``connection`` in GET /api/clusters/<id>/ (its shape, described here) and
POST /api/clusters/<id>/ssh-certificates/, a short-lived certificate for a node login.

The certificate is in the answer and nowhere else: not in a log line (machines/ssh_certificates.py logs
its key id), not in the audit trail (which keeps the answer's ``message``, naming the key id), not in a
cache (``Cache-Control: no-store``). Refusals are the rules' sentences: 403 for the person, 400 for the
key, the node or a cluster not every machine of which is Up.
"""
from django.utils.cache import add_never_cache_headers
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import renderers, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from clusters import connection_info

USAGE = ("Save the certificate beside your private key as <key>-cert.pub (for ~/.ssh/id_ed25519, "
         "~/.ssh/id_ed25519-cert.pub): ssh offers it with the key, and each ssh_command logs in with it.")


class ConnectionNodeSerializer(serializers.Serializer):
    rank = serializers.IntegerField(help_text="0 is the head")
    name = serializers.CharField(help_text="What the nodes call each other: node-0, node-1, ...")
    machine = serializers.CharField(help_text="The machine's name in the console")
    machine_id = serializers.IntegerField()
    address = serializers.CharField(help_text="Its address on the cluster network")
    interface = serializers.CharField(help_text="Its own name for its interface on the cluster network")
    gpus = serializers.IntegerField()
    free_gpus = serializers.ListField(child=serializers.IntegerField(), help_text="The indices of its GPUs no copy of a model "
                                      "holds now: what your own jobs may use (cluster.env's FADEN_FREE_GPUS)")
    vendor = serializers.CharField(allow_blank=True)
    ssh_user = serializers.CharField()
    ssh_address = serializers.CharField(help_text="Where ssh reaches it")
    ssh_port = serializers.IntegerField()
    host_key_fingerprint = serializers.CharField(allow_blank=True, help_text="Its SSH host key (SHA256:...), as the console "
                                                                           "trusts it: what ssh asks you to confirm")
    ssh_command = serializers.CharField(help_text="Through the jump host when the machines are not reachable from outside")


class SnippetsSerializer(serializers.Serializer):
    ssh_commands = serializers.DictField(child=serializers.CharField(), help_text="By node name")
    torchrun = serializers.CharField(help_text="From the head: torchrun on every node over the cluster's own SSH")
    torchrun_node = serializers.CharField(help_text="The same command, run on each node")
    mpirun = serializers.CharField()
    deepspeed = serializers.CharField()
    ray_job_submit = serializers.CharField(help_text="From your computer, through ray_tunnel")
    ray_tunnel = serializers.CharField(help_text="ssh -N -L to Ray's dashboard and job API, and Ray Client, on the head")


class ConnectionSerializer(serializers.Serializer):
    network = serializers.CharField(help_text="The cluster network, CIDR")
    head_address = serializers.CharField(help_text="MASTER_ADDR")
    master_port = serializers.IntegerField(help_text="MASTER_PORT")
    jump = serializers.CharField(allow_blank=True, help_text="The ProxyJump host of every ssh_command; empty when the machines are reachable")
    hostfile = serializers.CharField(help_text="Where the hostfile is on every node")
    env_file = serializers.CharField(help_text="Each node's settings, read by every login shell")
    nodes = ConnectionNodeSerializer(many=True)
    snippets = SnippetsSerializer()


def connection_fields(cluster) -> dict:
    """``connection`` and ``connection_reason`` of the cluster's detail: the nodes and commands once
    every machine is Up, else null and the card's sentence."""
    try:
        return {"connection": connection_info.connection_of(cluster).as_dict(), "connection_reason": ""}
    except connection_info.NotConnectable as waiting:
        return {"connection": None, "connection_reason": str(waiting)}


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "integer"}], "nullable": True})
class NodeField(serializers.Field):
    """A node by name (node-1), rank (1) or machine name (lab-b)."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, (str, int)):
            raise serializers.ValidationError("A node is its name (node-1), its rank (1) or its machine's name.")
        text = str(data).strip()
        if len(text) > 100:
            raise serializers.ValidationError("No node has a name this long.")
        return text

    def to_representation(self, value):
        return value


class SSHCertificateRequestSerializer(serializers.Serializer):
    public_key = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False, max_length=20000,
                                       help_text="One OpenSSH public key line: ssh-ed25519 AAAA... you@laptop")
    key = serializers.CharField(required=False, allow_blank=True, max_length=100,
                                help_text="Instead of public_key: the name of one of your keys (GET /api/profile/keys/)")
    node = NodeField(required=False, allow_null=True, help_text="One node (name, rank or machine); every node when left out")


class SSHCertificateSerializer(serializers.Serializer):
    message = serializers.CharField(help_text="What was signed, in words (the audit trail keeps this, never the certificate)")
    certificate = serializers.CharField(help_text="The OpenSSH certificate line: save it as <key>-cert.pub")
    key_id = serializers.CharField(help_text="fadenstack:<user>:<cluster>:<serial>, as sshd logs each login")
    serial = serializers.IntegerField()
    principals = serializers.ListField(child=serializers.CharField())
    valid_after = serializers.DateTimeField()
    valid_before = serializers.DateTimeField()
    usage = serializers.CharField()
    jump = serializers.CharField(allow_blank=True, help_text="The ProxyJump host, when the machines are not reachable from outside")
    nodes = ConnectionNodeSerializer(many=True, help_text="The nodes it opens, each with its ssh_command")


class ConnectionActions:
    """The cluster viewset's certificate action (config/cluster_api.py mixes it in)."""

    @extend_schema(request=SSHCertificateRequestSerializer, responses={201: SSHCertificateSerializer})
    @action(detail=True, methods=["post"], url_path="ssh-certificates", renderer_classes=[renderers.JSONRenderer])
    def ssh_certificates(self, request, pk=None):
        """A certificate for a node login as root, valid FADEN_SSH_CERT_SECONDS (an hour by default), for
        your public key (pasted, or one of your keys by name): every node of the cluster, or the one
        ``node``. For Administrators, and Operators an Administrator allowed node logins."""
        cluster = self.get_object()
        data = SSHCertificateRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        asked = data.validated_data
        login = connection_info.node_login_certificate(user=request.user, cluster=cluster, public_key=asked.get("public_key", ""),
                                               key_name=asked.get("key", ""), node=asked.get("node"))
        issued, reach = login.issued, login.reach
        one = login.nodes[0] if asked.get("node") not in (None, "") else None
        which = f"node {one.name} ({one.machine})" if one else "every node"
        body = {
            "message": f"Signed the certificate {issued.key_id} for {which} of {cluster.name}, valid until "
                       f"{issued.valid_before.isoformat(timespec='seconds')}.",
            "certificate": issued.certificate,
            "key_id": issued.key_id,
            "serial": issued.serial,
            "principals": list(issued.principals),
            "valid_after": issued.valid_after,
            "valid_before": issued.valid_before,
            "usage": USAGE,
            "jump": reach.jump,
            "nodes": [reach.node_dict(n) for n in login.nodes],
        }
        response = Response(SSHCertificateSerializer(body).data, status=status.HTTP_201_CREATED)
        add_never_cache_headers(response)
        return response
