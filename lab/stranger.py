"""A stranger on the lab's networks: a network namespace of its own (``fl-stranger``) with a link on
each network it is given (host .200 of each, an address no machine, the hub or the console has), from
which the tests try to open TCP connections to the machines, as someone on the same wires would.

    with Stranger(["mgmt", "fabric"], subnets) as stranger:
        stranger.connect([("198.18.1.11", 6379), ...])   # {(address, port): "open" | "refused" | "timeout" | ...}

``connect`` runs one Python of the host in the namespace (standard library only); every attempt runs
at once, each with its own timeout, so ten doors take one timeout, not ten. The links are veth pairs on
the lab's bridges (``flb-NET``), named ``fls-NET`` on the host so that ``faden lab down --all`` sweeps
them with the rest; the namespace is a lab one (``fl-``) for the same reason.
"""

from __future__ import annotations

import ipaddress
import json
import sys

from . import netns
from .util import LabError, run

NAME = "fl-stranger"
HOST_NUMBER = 200  # its address on every network: .200 (machines are .11 up, the hub .250)
CONNECT_SCRIPT = r"""
import json, socket, sys, threading
targets, timeout = json.loads(sys.argv[1]), float(sys.argv[2])
found = {}
def one(address, port):
    try:
        socket.create_connection((address, port), timeout=timeout).close()
        found["%s:%d" % (address, port)] = "open"
    except ConnectionRefusedError:
        found["%s:%d" % (address, port)] = "refused"
    except socket.timeout:
        found["%s:%d" % (address, port)] = "timeout"
    except OSError as exc:
        found["%s:%d" % (address, port)] = "error: %s" % exc
threads = [threading.Thread(target=one, args=(a, p)) for a, p in targets]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(found))
"""


def connect_command(targets: list, timeout: float) -> list:
    """The argv that tries every ``(address, port)`` at once and prints what each did, as JSON."""
    return [sys.executable, "-c", CONNECT_SCRIPT, json.dumps([[a, int(p)] for a, p in targets]), str(timeout)]


def parse_connect(stdout: str) -> dict:
    found = json.loads(stdout.strip().splitlines()[-1])
    return {(key.rsplit(":", 1)[0], int(key.rsplit(":", 1)[1])): value for key, value in found.items()}


class Stranger:
    """The stranger's namespace and links; ``subnets``: network name -> its subnet (the lab's spec or status)."""

    def __init__(self, networks: list, subnets: dict):
        self.networks = list(networks)
        self.addresses = {}
        for name in self.networks:
            if name not in subnets:
                raise LabError(f"the lab has no network {name!r} (it has {', '.join(sorted(subnets))})", exit_code=2)
            self.addresses[name] = str(ipaddress.ip_network(subnets[name])[HOST_NUMBER])
        self.prefix = {name: ipaddress.ip_network(subnets[name]).prefixlen for name in self.networks}

    def __enter__(self) -> Stranger:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        self.down()  # what an interrupted run left
        run(["ip", "netns", "add", NAME])
        run(["ip", "-n", NAME, "link", "set", "lo", "up"])
        for network in self.networks:
            host_end, inside = f"fls-{network}"[:15], f"fst-{network}"[:15]
            run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", inside])
            run(["ip", "link", "set", inside, "netns", NAME])
            run(["ip", "-n", NAME, "addr", "add", f"{self.addresses[network]}/{self.prefix[network]}", "dev", inside])
            run(["ip", "-n", NAME, "link", "set", inside, "up"])
            run(["ip", "link", "set", host_end, "master", f"flb-{network}", "up"])

    def down(self) -> None:
        netns.kill_netns_processes(NAME)
        netns.delete_netns(NAME)
        for network in self.networks:
            netns.delete_link(f"fls-{network}"[:15])

    def connect(self, targets: list, timeout: float = 2.0) -> dict:
        """Try a TCP connection to every ``(address, port)`` from the stranger; what each did:
        ``open``, ``refused`` (nothing listens, or a reset), ``timeout`` (dropped) or ``error: ...``."""
        done = run(["nsenter", f"--net=/run/netns/{NAME}", *connect_command(targets, timeout)], timeout=timeout + 30)
        return parse_connect(done.stdout)
