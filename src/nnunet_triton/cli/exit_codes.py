"""The exit codes of every ``nnunet-triton`` command: one policy, documented in ``--help``.

    0  OK           the command did what was asked
    1  CHECK_FAILED a check ran and failed (validate below its goals, a health or self-check that did not
                    pass)
    2  USAGE        bad usage or a project error (a wrong argument, a folder that is not a results folder,
                    a server that answered with an error)
    3  NOT_RUNNING  the server or node the command needs is not running

argparse's own usage errors already exit with 2, so "2" means "fix the command or the project".
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


EPILOG = ("exit codes: 0 ok, 1 a check failed, 2 bad usage or project error, "
          "3 the server or node is not running")
