"""Whether a process is alive."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


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
