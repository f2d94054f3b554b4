"""The exit codes of every command of the project: one policy, documented in ``--help``.

    0  OK           the command did what was asked
    1  CHECK_FAILED a check ran and failed (validate below its goals, a health or self-check that did not
                    pass)
    2  USAGE        bad usage or a project error (a wrong argument, a folder that is not a results folder,
                    a server that answered with an error)
    3  NOT_RUNNING  the server or node the command needs is not running
   78  CONFIG       the serving container's entry point refuses a repository or setup it cannot serve
                    (``EX_CONFIG`` of sysexits.h; a ``docker run`` restart policy gives up on it)

argparse's own usage errors already exit with 2, so "2" means "fix the command or the project". This module
imports only the standard library: the health probe, the watchdog, the thread budget and the container
entry point (processes that must start fast) read it as the console commands do. The mapping from the
errors a command ends with to these codes is ``nnunet_triton.cli.exit_code``.
"""

from __future__ import annotations

import enum

__all__ = ["EPILOG", "ExitCode"]


class ExitCode(enum.IntEnum):
    """What a command's exit status means."""

    OK = 0
    CHECK_FAILED = 1
    USAGE = 2
    NOT_RUNNING = 3
    CONFIG = 78


EPILOG = ("exit codes: 0 ok, 1 a check failed, 2 bad usage or project error, "
          "3 the server or node is not running")
