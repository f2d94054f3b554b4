"""Whether a process is alive, and the one way to end one: a signal, a wait, then SIGKILL.

:func:`terminate` is the only "ask, wait ``grace_s``, then kill" of the project (the server, its watchdog,
the TLS proxy, the image check's server); :func:`kill` the only immediate SIGKILL (a server that must not be
left behind unrecorded, an nginx master's orphaned workers, lingering Python-backend stubs)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

__all__ = ["kill", "pid_alive", "terminate", "wait_gone"]


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (exited, waiting to be reaped).

    Reads ``/proc/<pid>/stat`` where there is a ``/proc`` (any user's process, zombies told apart);
    elsewhere asks the kernel with signal 0 (a process of another user counts as alive). Ids <= 0 name
    process groups, not a process: False.
    """
    if pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill(pid: int, *, group: bool = False) -> None:
    """SIGKILL process ``pid`` (``group``: its process group, ``pid`` being the group's leader); one that is
    already gone is no error."""
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)


def wait_gone(alive: Callable[[], bool], timeout_s: float, *, poll_s: float = 0.05) -> bool:
    """Poll ``alive()`` until it is False or ``timeout_s`` passed; whether it ended."""
    deadline = time.monotonic() + timeout_s
    while alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def terminate(pid: int, grace_s: float, *, sig: int | None = signal.SIGTERM, group: bool = False,
              alive: Callable[[], bool] | None = None, kill_wait_s: float = 0.0,
              poll_s: float = 0.05) -> bool:
    """Send ``sig`` to ``pid`` (None: send nothing, only wait), wait up to ``grace_s`` for it to end, then
    SIGKILL it (``group``: its whole process group, so that children it leaves behind go too) and wait up
    to ``kill_wait_s`` more. Whether it ended within the grace (no SIGKILL was needed).

    ``alive``: how to tell it still runs (default :func:`pid_alive`, for which an exited child not reaped
    yet counts as gone; a caller holding a ``Popen`` reaps it after). A process already gone is no error.
    """
    alive = alive if alive is not None else (lambda: pid_alive(pid))
    if sig is not None and alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if wait_gone(alive, grace_s, poll_s=poll_s):
        return True
    kill(pid, group=group)
    wait_gone(alive, kill_wait_s, poll_s=poll_s)
    return False
