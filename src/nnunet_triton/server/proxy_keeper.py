"""Start the TLS proxy again when its nginx died (the watchdog asks every tick).

A dead proxy leaves the public endpoint closed, not open; this brings it back without a person. nginx's
workers outlive a master killed by SIGKILL and keep the listening socket, so the dead master's process group
(its workers: ``comm`` nginx) is killed before the new master binds the port.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

from nnunet_triton.server.proxy import kill_orphaned_workers, launch, nginx_command, running_pid
from nnunet_triton.util.process import kill
from nnunet_triton.util.retry import RetryPolicy

__all__ = ["ProxyKeeper"]

LOGGER = logging.getLogger(__name__)
RESTART_BACKOFF = RetryPolicy(backoff_s=2.0, max_delay_s=60.0)  # 2, 4, 8, ... 60 s between failed starts


class ProxyKeeper:
    """Keeps the nginx of ``config_file`` running; the restarted one dies with this process."""

    def __init__(self, config_file: str | Path, *, start_timeout_s: float = 30.0) -> None:
        self.config_file = Path(config_file).absolute()
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._failures = 0  # restarts in a row that did not come up: the next try waits 2^n s (<= 60 s)
        self._next_try = 0.0
        self._last_pid = running_pid(self.config_file)
        self._process: subprocess.Popen[bytes] | None = None

    def check(self) -> bool:
        """Start the proxy again when it is not running; True when it was restarted."""
        if self._process is not None:
            self._process.poll()  # reap a restarted master that died
        pid = running_pid(self.config_file)
        if pid is not None:
            self._last_pid, self._failures = pid, 0
            return False
        if time.monotonic() < self._next_try:
            return False
        if self._last_pid is not None:
            kill_orphaned_workers(self._last_pid)  # they still hold the port
        LOGGER.warning("the TLS proxy (nginx on %s, pid %s) is not running; starting it again",
                       self.config_file, self._last_pid)
        self._process = launch(nginx_command(self.config_file), detach=False)
        deadline = time.monotonic() + self.start_timeout_s
        while running_pid(self.config_file) is None and self._process.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        started = running_pid(self.config_file)
        self.restarts += 1
        if started is not None:
            self._last_pid = started
            LOGGER.warning("the TLS proxy runs again (nginx pid %d)", started)
        else:
            if self._process.poll() is None:  # neither up nor gone: do not leave it behind
                kill(self._process.pid)
                self._process.wait()
            self._failures += 1
            delay = RESTART_BACKOFF.delay(self._failures - 1)
            self._next_try = time.monotonic() + delay
            LOGGER.error("the TLS proxy did not start again (see %s); next try in %.0f s",
                         self.config_file.parent / "nginx-error.log", delay)
        return True
