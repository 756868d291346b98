"""The ports a cluster's machines listen on, pinned so that the cluster's firewall can name them.

Ray's servers bind the machine's cluster address (never 0.0.0.0); the head's dashboard and job API
stay on its loopback (``rayargs.DASHBOARD_HOST``).  The copies' ports are the console's
``FADEN_COPY_PORTS`` (8100-8199 by default) and the file servers' port is the console's
``SERVE_PORT``: both reach the agent on its command line.
"""

GCS = 6379                     # the head's GCS (--port)
NODE_MANAGER = 6380            # each raylet (--node-manager-port)
OBJECT_MANAGER = 6381          # each object manager (--object-manager-port)
DASHBOARD_AGENT_GRPC = 6382    # each node's dashboard agent (--dashboard-agent-grpc-port)
DASHBOARD_AGENT_HTTP = 6383    # ... its HTTP side, which accepts job submissions (--dashboard-agent-listen-port)
METRICS_EXPORT = 6384          # each node's metrics (--metrics-export-port)
RUNTIME_ENV_AGENT = 6385       # each node's runtime-env agent (--runtime-env-agent-port)
RAY_CLIENT = 10001             # the head's Ray Client server (--ray-client-server-port)
WORKERS = (10002, 10199)       # the workers' ports (--min-worker-port / --max-worker-port)
COPY_RAY = (20000, 20999)      # the Ray of the copies that span machines (their own, beside the cluster's)

# Every single Ray port a member reaches on another member, for the firewall.
RAY_SINGLE = (GCS, NODE_MANAGER, OBJECT_MANAGER, DASHBOARD_AGENT_GRPC, DASHBOARD_AGENT_HTTP,
              METRICS_EXPORT, RUNTIME_ENV_AGENT, RAY_CLIENT)
RAY_RANGES = (WORKERS, COPY_RAY)

# The head's two Prometheus endpoints (the dashboard's and the autoscaler's metrics), which Ray serves on
# every address whatever the node's (read-only metrics, no authentication): pinned by Ray's own variables
# DASHBOARD_METRIC_PORT and AUTOSCALER_METRIC_PORT (its defaults 44227 and 44217) so that the firewall can
# close them; nothing of Fadenstack reads them.
DASHBOARD_METRICS = 6386
AUTOSCALER_METRICS = 6387
HEAD_METRICS = (DASHBOARD_METRICS, AUTOSCALER_METRICS)
