"""A thread that does one thing every few seconds while a block of code runs."""
import logging
import threading

from django.db import connections

log = logging.getLogger(__name__)


class Ticker:
    """Calls ``tick()`` every ``every()`` seconds from a thread with its own database connection,
    from entering the ``with`` block until leaving it; once more on leaving with ``tick_on_exit``.
    A tick that fails is logged and the next one runs: the work in the block goes on regardless."""

    tick_on_exit = False

    def __init__(self, name: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def every(self) -> float:
        raise NotImplementedError

    def tick(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self.tick_on_exit:
            self.tick()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every()):
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - see the class's docstring
                    log.exception("%s: tick failed", self._thread.name)
        finally:
            connections.close_all()
