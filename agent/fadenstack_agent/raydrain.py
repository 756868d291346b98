"""``ray drain --head ADDR:PORT --node-id HEX --reason TEXT``: Ray's own drain of a node (its GCS
``DrainNode`` call, reason preemption, no deadline), asked on the head: Ray schedules nothing new on the
node and lets it go once it runs nothing.  Ray has no undrain: the node leaves Ray and joins again.
Like ``ray status``, it runs the runtime driver's ``python`` (in the container with ``docker`` and
``podman``) with a short script (``rayargs.DRAIN_SCRIPT``) and reads the line it prints.
"""


import subprocess
import time

from . import runtime
from .cli import STORE, arg, command
from .files import store_dir
from .protocol import NOT_RETRYABLE, RETRYABLE, AgentError
from .ray import HEAD, _text
from .rayargs import (DRAIN_MARK, STATUS_LOOKUP, STATUS_SLACK, build_address, drain_argv, parse_host_port,
                      parse_node_id, parse_status_output, status_env, summarize_failure)
from .rayproc import check_reachable, resolve_head
@command("ray", "drain", args=[HEAD, arg("--node-id", required=True, metavar="HEX", help="the Ray node to drain"),
                               arg("--reason", required=True, metavar="TEXT", help="why, in words Ray keeps"), STORE])
def cmd_drain(args, out) -> int:
    """``ray drain --head ADDR:PORT --node-id HEX --reason TEXT``: Ray's drain of one node, asked on the head.

    Ray schedules nothing new on the node; it leaves Ray once it runs nothing (Ray has no way back: it
    leaves Ray and joins again).  Result: ``{"head", "node_id", "accepted", "refusal" (Ray's words when
    not accepted), "seconds"}``.  A node Ray no longer knows is not an error: ``accepted`` false with
    Ray's words.  Errors: ``unreachable`` (nothing answers at the head), ``bad_input``, ``retryable``.
    """
    started = time.monotonic()
    host, port = parse_host_port(args.head)
    node_id = parse_node_id(args.node_id)
    reason = " ".join(str(args.reason).split())[:500] or "drained by Fadenstack"
    store = store_dir(args.store)
    driver = runtime.current_driver(store)
    driver.check()
    head = build_address(resolve_head(host), port)
    check_reachable(host, port)
    timeout = STATUS_LOOKUP + STATUS_SLACK
    try:
        proc = subprocess.run(drain_argv(driver, head, node_id, reason), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=status_env(STATUS_LOOKUP),
                              cwd="/", timeout=timeout)
    except (FileNotFoundError, PermissionError) as exc:
        raise AgentError(NOT_RETRYABLE, "cannot run %s: %s" % (driver.python, exc.strerror or exc))
    except subprocess.TimeoutExpired:
        raise AgentError(RETRYABLE, "Ray at %s did not answer the drain within %g s" % (head, timeout))
    answer = parse_status_output(_text(proc.stdout), mark=DRAIN_MARK)
    if answer is None:
        raise AgentError(RETRYABLE, "the Ray drain printed no answer (exit %s): %s"
                         % (proc.returncode, summarize_failure(_text(proc.stderr) or _text(proc.stdout))))
    if answer.get("error") == "import":
        raise AgentError(NOT_RETRYABLE, "%s cannot import Ray's drain (%s driver): %s"
                         % (driver.python, driver.name, answer.get("message")))
    if answer.get("error"):
        raise AgentError(RETRYABLE, "Ray at %s: %s" % (head, answer.get("message")))
    return out.result(head=head, node_id=node_id, accepted=bool(answer.get("accepted")),
                      refusal=str(answer.get("refusal") or ""), seconds=round(time.monotonic() - started, 3))
