"""`faden lab ...`: up, down, status, fault, images, hub. Entry point: ``main(argv)``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import core, faults, hub, images
from .state import LabState, state_dir_from_env
from .util import LabError, UsageError

DESCRIPTION = """\
Virtual GPU machines on this host (network namespaces running sshd).
State dir: $FADEN_LAB_DIR (default /var/tmp/fadenstack-lab).
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other refusal
        print(f"faden lab: {message} (see `faden lab --help`)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="faden lab", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    up = commands.add_parser("up", help="build the lab from a spec")
    up.add_argument("--spec", help="spec file (TOML); default: lab/specs/default.toml")
    up.add_argument("--authorized-key", metavar="PUBKEY_FILE",
                    help="public key allowed to log in as root "
                         "(or $FADEN_LAB_AUTHORIZED_KEY; none: the lab makes one)")
    down = commands.add_parser("down", help="remove everything the lab made")
    down.add_argument("--all", action="store_true", dest="everything",
                      help="take down whatever lab this host holds, from any state dir, "
                           "and leftovers of interrupted runs")
    status = commands.add_parser("status", help="machines, addresses, host keys, faults")
    status.add_argument("--json", action="store_true", help="print JSON")
    fault = commands.add_parser(
        "fault", help="inject a fault into a machine",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="kinds:\n" + faults.kinds_help())
    fault.add_argument("machine")
    fault.add_argument("kind")
    fault.add_argument("args", nargs="*", metavar="ARG")
    runtime = commands.add_parser("runtime", help="switch machines' container runtime (their agent config): "
                                                 "podman, as a real machine, or process, the fast path")
    runtime.add_argument("runtime", choices=("podman", "process"))
    runtime.add_argument("machines", nargs="+", metavar="MACHINE")
    made = commands.add_parser("images", help="build the lab's runtime images (NVIDIA x86_64 and aarch64): "
                                              "Debian, Python and Ray, cached by their inputs")
    made.add_argument("--synthetic-mib", type=int, metavar="MIB",
                      help="instead, images whose one layer is MIB of random bytes: for tests that move "
                           "images but never run them (the process driver)")
    made.add_argument("--out", metavar="DIR", help="where to write them (default: <state dir>/images)")
    hub_command = commands.add_parser("hub", help="serve a lab hub (a stand-in for the Hugging Face Hub) until "
                                                  "interrupted; `up` starts the lab's own on the management network")
    hub_command.add_argument("--bind", default="127.0.0.1", metavar="ADDR", help="address (default 127.0.0.1)")
    hub_command.add_argument("--port", type=int, default=hub.DEFAULT_PORT, metavar="N",
                             help=f"port (default {hub.DEFAULT_PORT}; 0: any free port)")
    hub_command.add_argument("--token", action="append", default=[], dest="tokens", metavar="TOKEN",
                             help="a token that may download gated models (repeatable)")
    hub_command.add_argument("--token-file", metavar="PATH",
                             help="a file of such tokens, one a line (keeps them off the command line)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        options = build_parser().parse_args(argv)
    except SystemExit as exit:
        return int(exit.code or 0)
    state = LabState(state_dir_from_env())
    try:
        if options.command == "up":
            print(core.up(state, options.spec, options.authorized_key))
        elif options.command == "down":
            print(core.down(state, everything=options.everything))
        elif options.command == "status":
            result = core.status(state)
            print(json.dumps(result, indent=2) if options.json else format_status(result))
        elif options.command == "fault":
            print(faults.apply_fault(state, options.machine, options.kind, options.args))
        elif options.command == "runtime":
            print(core.set_runtime(state, options.machines, options.runtime))
        elif options.command == "images":
            print(make_images(options.out or state.root / "images", options.synthetic_mib))
        elif options.command == "hub":
            tokens = options.tokens + (hub.read_token_file(options.token_file) if options.token_file else [])
            hub.serve(options.bind, options.port, tokens)
    except LabError as error:
        print(f"faden lab {options.command}: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"faden lab {options.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as error:
        print(f"faden lab {options.command}: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # a bug: still one line, the traceback on request
        if os.environ.get("FADEN_LAB_DEBUG"):
            raise
        print(f"faden lab {options.command}: internal error: {type(error).__name__}: {error} "
              "(FADEN_LAB_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    return 0


def make_images(out_dir, synthetic_mib: int | None) -> str:
    """The paths alone on stdout (``faden runtime-images import $(faden lab images)``); notes on stderr."""
    if synthetic_mib is not None and synthetic_mib < 1:
        raise UsageError("--synthetic-mib must be at least 1")
    started = time.monotonic()
    made = images.images_make(out_dir, synthetic_mib)
    for path, written in made:
        note = "built" if written else "already there from the same layers: kept"
        print(f"faden lab images: {path.name} ({path.stat().st_size / 2**20:.0f} MiB) {note}", file=sys.stderr)
    print(f"faden lab images: {time.monotonic() - started:.1f}s", file=sys.stderr)
    return "\n".join(str(path) for path, _ in made)


def format_status(result: dict) -> str:
    if not result["up"]:
        if result.get("stale"):
            return ("lab is not up, but a state is left behind "
                    f"({result.get('state')}): run `faden lab down`")
        return "lab is not up"
    lines = [f"lab is up: console address {result['console_address']}, "
             f"state {result['state_dir']}"]
    if result.get("private_key"):
        lines.append(f"ssh key: {result['private_key']} (made by the lab)")
    hub = result.get("hub")
    if hub:
        lines.append(f"hub: {hub['url']} ({'running' if hub['running'] else 'NOT RUNNING'}, "
                     f"{hub['rate_mbit']:g} Mbit/s, {len(hub['models'])} models; token file {hub['token_file']})")
    lines.append("")
    rows = [("MACHINE", "ADDRESS", "POWER", "SSHD", "ARCH", "ACCELERATORS", "NETWORKS",
             "HOST KEY", "FAULTS")]
    for machine in result["machines"]:
        spec = machine["spec"]
        accelerators = ", ".join(f"{a['count']} x {a['model']}" for a in spec["accelerators"])
        machine_faults = machine["faults"]
        notes = [f"{n} down" for n in machine_faults["links_down"]]
        notes += [f"{n} {rate:g}mbit" for n, rate in machine_faults["link_rates"].items()]
        notes += [f"port {port} taken" for port in machine_faults["ports_taken"]]
        if machine_faults["disk_full"]:
            notes.append("disk full")
        if machine_faults.get("hub_cut"):
            notes.append("hub cut")
        rows.append((
            machine["name"], machine["address"], "on" if machine["powered"] else "off",
            "up" if machine["sshd_running"] else "down", spec["arch"], accelerators or "-",
            ",".join(n["name"] for n in spec["networks"]),
            machine["host_key_fingerprint"] or "-", "; ".join(notes) or "-",
        ))
    lines += _table(rows)
    lines.append("")
    rows = [("NETWORK", "SUBNET", "BRIDGE", "INTERFACE", "RATE")]
    for network in result["networks"]:
        rows.append((network["name"], network["subnet"], network["bridge"], network["interface"],
                     f"{network['rate_mbit']:g} Mbit/s"))
    lines += _table(rows)
    return "\n".join(lines)


def _table(rows) -> list[str]:
    widths = [max(len(str(row[column])) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in rows]
