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

__all__ = ["ProxyKeeper"]

LOGGER = logging.getLogger(__name__)


class ProxyKeeper:
    """Keeps the nginx of ``config_file`` running; the restarted one dies with this process."""

    def __init__(self, config_file: str | Path, *, start_timeout_s: float = 30.0) -> None:
        self.config_file = Path(config_file).absolute()
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._last_pid = running_pid(self.config_file)
        self._process: subprocess.Popen[bytes] | None = None

    def check(self) -> bool:
        """Start the proxy again when it is not running; True when it was restarted."""
        if self._process is not None:
            self._process.poll()  # reap a restarted master that died
        pid = running_pid(self.config_file)
        if pid is not None:
            self._last_pid = pid
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
        self._last_pid = running_pid(self.config_file)
        self.restarts += 1
        if self._last_pid is None:
            LOGGER.error("the TLS proxy did not start again (see %s)",
                         self.config_file.parent / "nginx-error.log")
        else:
            LOGGER.warning("the TLS proxy runs again (nginx pid %d)", self._last_pid)
        return True
