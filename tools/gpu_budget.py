"""The GPU check's time budget: one command runs every stage in order of value and stops itself in time.

The GPU test machine lends 15 minutes in all (its start included) and returns only what lies under
``$OUT`` (at most 8 files). So ``tools.gpu_check --budget-s S`` runs its stages in ``STAGE_ORDER`` (parity
first: it needs no server and finds most defects; then the endpoint against nnUNetPredictor; then the
timings), starts a stage only when the time left covers its ``MIN_STAGE_SECONDS``, and a watchdog stops a
stage still running ``RESERVE_S`` before the budget's end: it writes the report with that stage marked
``stopped (budget)`` and exits with ``EXIT_BUDGET``, so an outer ``timeout`` never kills a stage that
would then leave no section.

Exit statuses (:func:`exit_status`): ``EXIT_GREEN`` 0 every stage ran and none failed; ``EXIT_DEFECT`` 1 a
stage failed (a real defect: a parity row, the Dice, a goal); ``EXIT_BUDGET`` 3 nothing failed, but a
stage was stopped or not started for lack of time (rerun the missing stages with ``--stages``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["STAGE_ORDER", "MIN_STAGE_SECONDS", "RESERVE_S", "EXIT_GREEN", "EXIT_DEFECT", "EXIT_BUDGET",
           "BUDGET_STOPPED", "BUDGET_NOT_STARTED", "Budget", "ordered_stages", "exit_status"]

STAGE_ORDER = ("parity", "endpoint", "timings")
# the least time a stage needs on the GPU machine to finish (server start, CUDA context, the weights made
# for the timings): a stage is not started with less left, and the remaining ones are reported as not run
MIN_STAGE_SECONDS: Mapping[str, float] = {"parity": 30.0, "endpoint": 90.0, "timings": 150.0}
RESERVE_S = 15.0  # kept back to write the report, stop the server and exit before the budget's end
EXIT_GREEN, EXIT_DEFECT, EXIT_BUDGET = 0, 1, 3
BUDGET_STOPPED = "stopped (budget)"
BUDGET_NOT_STARTED = "not started (budget)"


def ordered_stages(wanted: Iterable[str]) -> list[str]:
    """``wanted`` in ``STAGE_ORDER``; an unknown name raises naming the known ones."""
    wanted = [w.strip() for w in wanted if w.strip()]
    unknown = sorted(set(wanted) - set(STAGE_ORDER))
    if unknown:
        raise ValueError(f"--stages: unknown stage(s) {unknown}, expected a comma list of "
                         f"{list(STAGE_ORDER)}.")
    return [name for name in STAGE_ORDER if name in wanted]


@dataclass
class Budget:
    """``total_s`` seconds from ``start`` (default: construction; ``total_s`` None: unlimited), read from
    ``clock`` (``time.monotonic`` is system-wide on Linux, so a start taken before an ``exec`` holds)."""

    total_s: float | None
    reserve_s: float = RESERVE_S
    clock: Callable[[], float] = time.monotonic
    start: float | None = None

    def __post_init__(self) -> None:
        if self.total_s is not None and self.total_s <= self.reserve_s:
            raise ValueError(f"--budget-s must exceed the reserve of {self.reserve_s:g} s kept to write the "
                             f"report, got {self.total_s:g}.")
        if self.start is None:
            self.start = self.clock()

    def left_s(self) -> float:
        """Seconds left before the reserve (may be negative); infinite without a budget."""
        if self.total_s is None:
            return float("inf")
        return self.total_s - self.reserve_s - (self.clock() - self.start)

    def allows(self, stage: str, *, min_seconds: Mapping[str, float] = MIN_STAGE_SECONDS) -> bool:
        """Whether ``stage`` may start: the time left covers its minimum."""
        return self.left_s() >= min_seconds.get(stage, 0.0)

    def watchdog(self, on_expiry: Callable[[], None]) -> threading.Timer | None:
        """A started daemon timer calling ``on_expiry`` when the time left reaches zero (None: no budget).
        ``on_expiry`` must end the process (it runs on the timer's thread)."""
        if self.total_s is None:
            return None
        timer = threading.Timer(max(0.0, self.left_s()), on_expiry)
        timer.daemon = True
        timer.start()
        return timer


def exit_status(statuses: Iterable[str]) -> int:
    """The command's exit status from its stages' statuses (see the module docstring)."""
    statuses = list(statuses)
    if "failed" in statuses:
        return EXIT_DEFECT
    if BUDGET_STOPPED in statuses or BUDGET_NOT_STARTED in statuses:
        return EXIT_BUDGET
    return EXIT_GREEN
