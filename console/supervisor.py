"""The processes ``faden serve`` runs, watched: one that may be restarted alone (the gateway) is started again
when it dies, with a growing pause when it keeps dying; any other that stops stops them all."""
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_PAUSE = 1.0  # seconds before the first restart
LONGEST_PAUSE = 60.0  # the pause doubles at each death in a row, up to this
STEADY = 60.0  # a process that ran this long before it died starts a new series (the pause back to FIRST_PAUSE)


@dataclass
class Child:
    name: str
    argv: list[str]
    restart: bool
    process: subprocess.Popen | None = None
    started: float = 0.0
    pause: float = 0.0  # the pause before the next restart; 0 until it first dies
    due: float | None = None  # when it is to be started again
    restarts: int = 0
    env: dict | None = field(default=None, repr=False)


class Supervisor:
    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.say, self.clock = say, clock
        self.children: dict[str, Child] = {}

    def spawn(self, name: str, argv: list[str], *, restart: bool = False, env: dict | None = None) -> None:
        child = self.children[name] = Child(name, argv, restart, env=env)
        self._start(child)

    def _start(self, child: Child) -> None:
        child.process = subprocess.Popen(child.argv, start_new_session=True, env=child.env)
        child.started, child.due = self.clock(), None

    def process(self, name: str) -> subprocess.Popen | None:
        return self.children[name].process

    def check(self) -> Child | None:
        """Look at every process once: restart those that may be and are due, and return the first one that
        stopped and may not be restarted (the caller stops everything), else None."""
        now = self.clock()
        for child in self.children.values():
            if child.due is not None:
                if now >= child.due:
                    child.restarts += 1
                    self.say(f"Starting the {child.name} process again (restart {child.restarts}).")
                    self._start(child)
                continue
            code = child.process.poll()
            if code is None:
                continue
            if not child.restart:
                return child
            _kill_group(child.process)  # what it left behind (uvicorn's workers hold the port)
            ran = now - child.started
            child.pause = FIRST_PAUSE if ran >= STEADY or not child.pause else min(child.pause * 2, LONGEST_PAUSE)
            child.due = now + child.pause
            self.say(f"The {child.name} process stopped with exit status {code} after {ran:.0f} s; the others keep "
                     f"running, and it starts again in {child.pause:g} s.")
        return None

    def stop(self, grace: float = 15) -> None:
        """SIGTERM to every process group, last started first, then SIGKILL for what has not ended in ``grace`` s."""
        running = [c.process for c in reversed(self.children.values()) if c.process is not None and c.due is None]
        for process in running:
            if process.poll() is None:
                _kill_group(process, signal.SIGTERM)
        for process in running:
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _kill_group(process)


def _kill_group(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
