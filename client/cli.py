"""The client's command line: ``faden ssh`` and ``faden clusters tunnel|test``, each with ``--url`` and
``--token``; ``config/cli.py`` hands these commands here before Django is set up."""
from __future__ import annotations

import argparse
import os
import sys

from client import nccl_test, ssh, tunnel
from client.api import ENV_TOKEN, ENV_URL, ClientError, Console, Send, urllib_send

COMMANDS = frozenset({"ssh", "clusters"})  # the faden commands this package answers (config/cli.py asks)


def parser() -> argparse.ArgumentParser:
    """Every client command, each with ``--url`` and ``--token`` (a subcommand per command: ``clusters
    tunnel`` is one more ``add_parser`` with its own ``run``)."""
    reach = argparse.ArgumentParser(add_help=False)
    reach.add_argument("--url", default=None, help=f"the console's URL (default ${ENV_URL})")
    reach.add_argument("--token", default=None, help=f"an API token (default ${ENV_TOKEN}, which keeps it out of ps)")
    top = argparse.ArgumentParser(prog="faden", description="The console's client commands, over its REST API.")
    commands = top.add_subparsers(dest="command_name", required=True)
    login = commands.add_parser("ssh", parents=[reach], help="log in to a node of a cluster as root with a short-lived certificate",
                                usage="faden ssh [-i KEY] [--url URL] [--token TOKEN] CLUSTER [NODE] [-- COMMAND...]",
                                description="Sign a certificate for your key and log in to the node with ssh; a command "
                                            "after -- runs there instead of a shell.")
    login.add_argument("cluster", help="the cluster's name")
    login.add_argument("node", nargs="?", help="node-1, its rank (1) or its machine's name; node-0 (the head) by default")
    login.add_argument("-i", dest="identity", default=None, metavar="KEY",
                       help=f"your private key or its .pub ({ssh.DEFAULT_KEY} by default)")
    login.set_defaults(run=ssh.ssh)
    clusters = commands.add_parser("clusters", help="a cluster's tunnel and NCCL test").add_subparsers(
        dest="clusters_command", required=True)
    forward = clusters.add_parser("tunnel", parents=[reach], help="forward Ray's dashboard, job API and Ray Client from the head",
                                  description="Sign a certificate for your key and hold ssh -N -L to the head's Ray "
                                              "dashboard and job API (8265) and Ray Client (10001) open until Ctrl-C.")
    forward.add_argument("cluster", help="the cluster's name")
    forward.add_argument("-i", "--key", dest="identity", default=None, metavar="KEY",
                         help=f"your private key or its .pub ({ssh.DEFAULT_KEY} by default)")
    forward.add_argument("--local-port", type=tunnel.tcp_port, default=tunnel.RAY_DASHBOARD_PORT,
                         help=f"this computer's port for the dashboard and job API ({tunnel.RAY_DASHBOARD_PORT})")
    forward.add_argument("--client-port", type=tunnel.tcp_port, default=tunnel.RAY_CLIENT_PORT,
                         help=f"this computer's port for Ray Client ({tunnel.RAY_CLIENT_PORT})")
    forward.set_defaults(run=tunnel.tunnel)
    sweep = clusters.add_parser("test", parents=[reach], help="run the NCCL test and print each size as it finishes",
                                description="An all-reduce across every GPU of every node; prints the bus bandwidth "
                                            "of each message size, then the peak.")
    sweep.add_argument("cluster", help="the cluster's name")
    sweep.add_argument("--yes", action="store_true", help="run it even while copies are serving on the cluster's GPUs")
    sweep.set_defaults(run=nccl_test.nccl_test)
    return top


def main(argv: list[str], *, send: Send = urllib_send, environ=os.environ) -> int:
    """``faden <command> ...`` for the commands of ``COMMANDS``; the exit status."""
    # What follows -- is the command to run on the node, whatever it looks like (as ssh takes it).
    argv, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    arguments = parser().parse_args(argv)
    arguments.command = command
    try:
        console = Console(arguments.url or environ.get(ENV_URL, ""), arguments.token or environ.get(ENV_TOKEN, ""), send=send)
        return arguments.run(arguments, console)
    except ClientError as failed:
        name = " ".join(filter(None, (arguments.command_name, getattr(arguments, "clusters_command", None))))
        print(f"faden {name}: {failed.message}", file=sys.stderr)
        return failed.code
