"""What Docker and Podman answer, read for the ``docker`` and ``podman``
runtime drivers (pure: the command lines are ``containers``', the drivers
``engines``).  Both engines' dialects are read here, so that the drivers
never guess at an engine's output.
"""

import json
import re

from .containers import CLUSTER_LABEL, CLUSTER_RE, NAME_PREFIX, container_name
from .protocol import NOT_RETRYABLE, AgentError

# docker: "Loaded image: NAME:TAG" / "Loaded image ID: sha256:..."; podman:
# "Loaded image: NAME:TAG" (4.x) / "Loaded image(s): A,B" (older).
LOADED_RE = re.compile(r"^Loaded image(?:\(s\))?(?: ID)?:\s*(\S.*)$")
NO_SUCH_RE = re.compile(r"no such (?:container|object)", re.IGNORECASE)


# ------------------------------------------------------------------ output


def _unexpected(what: str, output: str) -> AgentError:
    words = (output or "").strip()
    if len(words) > 400:
        words = "..." + words[-400:]
    return AgentError(NOT_RETRYABLE, "The container engine's %s output is not what it should be: %s"
                      % (what, words or "(nothing)"))


def parse_loaded(output: str) -> list:
    """The image references (or IDs) that ``load`` reports, first as printed."""
    found = []
    for line in (output or "").splitlines():
        match = LOADED_RE.match(line.strip())
        if match:
            for ref in match.group(1).split(","):
                if ref.strip() and ref.strip() not in found:
                    found.append(ref.strip())
    if not found:
        raise _unexpected("load", output)
    return found


def is_no_such_container(output: str) -> bool:
    """Docker ("No such object", "No such container") and Podman ("no such container")."""
    return bool(NO_SUCH_RE.search(output or ""))


def parse_state(output: str) -> dict:
    """``inspect --format '{{json .State}}'`` -> ``{"status", "running",
    "exit_code", "started_at", "finished_at", "error", "oom_killed", "pid"}``
    (``pid``: of the container's first process as this machine sees it, None
    when not running).

    A failed ``inspect`` (exit status not 0) is first told apart with
    ``is_no_such_container``: a missing container is a state, not an error.
    Times are the engine's own strings (Docker and Podman differ in zones).
    """
    try:
        state = json.loads((output or "").strip())
    except ValueError:
        raise _unexpected("inspect", output)
    if isinstance(state, list) and len(state) == 1:
        state = state[0]    # a plain `inspect` array of one, should a driver pass it
    if not isinstance(state, dict) or not isinstance(state.get("Status"), str):
        raise _unexpected("inspect", output)
    exit_code, pid = state.get("ExitCode"), state.get("Pid")
    return {"status": state["Status"].lower(), "running": state.get("Running") is True,
            "exit_code": exit_code if isinstance(exit_code, int) else None,
            "started_at": state.get("StartedAt") or None, "finished_at": state.get("FinishedAt") or None,
            "error": state.get("Error") or "", "oom_killed": state.get("OOMKilled") is True,
            "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None}


def _labels(value) -> dict:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        return dict(part.split("=", 1) for part in value.split(",") if "=" in part)
    return {}


def parse_ps(output: str) -> list:
    """``ps_argv``'s output -> ``[(name, cluster label)]`` of either engine."""
    text = (output or "").strip()
    if not text:
        return []
    try:
        rows = json.loads(text)
        if isinstance(rows, dict):
            rows = [rows]
    except ValueError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError:
            raise _unexpected("ps", output)
    found = []
    for row in rows if isinstance(rows, list) else [None]:
        names = row.get("Names") if isinstance(row, dict) else None
        if isinstance(names, str):
            names = names.split(",")
        if not isinstance(names, list) or not names or not isinstance(names[0], str):
            raise _unexpected("ps", output)
        found.append((names[0].lstrip("/"), _labels(row.get("Labels")).get(CLUSTER_LABEL)))
    return found


def left_by_others(containers, cluster: str) -> list:
    """The names of the containers another cluster left (``rm_argv(name=...)``).

    Only names of our own form: a container that carries the label under
    another name was not made by the agent, and is left alone.
    """
    own = container_name(cluster)
    return [name for name, label in containers
            if name != own and label != cluster and name.startswith(NAME_PREFIX)
            and CLUSTER_RE.match(name[len(NAME_PREFIX):])]
