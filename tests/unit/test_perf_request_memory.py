"""``tools.perf.request_memory``: the large volume is the case over a larger field of view."""

from __future__ import annotations

import numpy as np

from tools.perf.request_memory import enlarge
from tools.perf.workloads import Case


def test_enlarge_resamples_to_the_shape_at_the_cases_spacing():
    case = Case(name="c", image=np.arange(2 * 4 * 6 * 8, dtype=np.float32).reshape(2, 4, 6, 8),
                spacing=(3.0, 1.5, 1.0))
    big = enlarge(case, (8, 12, 32))
    assert (big.name, big.image.shape, big.image.dtype) == ("c-8x12x32", (2, 8, 12, 32), np.float32)
    assert big.spacing == (3.0, 1.5, 1.0)


_SHARED_TREE = """
import mmap, os, sys, time
size = 64 * 2**20
shared = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
shared.write(b"x" * size)
for _ in range(2):
    if os.fork() == 0:
        total = sum(shared[i] for i in range(0, size, 4096))  # every page mapped in the child too
        sys.stdout.write(f"child {total}\\n"); sys.stdout.flush()
        time.sleep(30)
        os._exit(0)
sys.stdout.write("ready\\n"); sys.stdout.flush()
time.sleep(30)
"""


def test_the_memory_of_a_process_tree_counts_a_shared_region_once_by_pss_and_thrice_by_rss():
    import subprocess
    import sys
    import time

    import psutil

    from tools.perf.resources import ProcessTreeSampler

    tree = subprocess.Popen([sys.executable, "-c", _SHARED_TREE], stdout=subprocess.PIPE, text=True)
    try:
        lines = [tree.stdout.readline() for _ in range(3)]
        assert sum(line.startswith("child") for line in lines) == 2 and "ready\n" in lines
        time.sleep(0.5)
        usage = ProcessTreeSampler(tree.pid, interval_s=0.1).start().stop()
    finally:
        for child in psutil.Process(tree.pid).children():  # before the parent: orphans would outlive it
            child.kill()
        tree.kill()
        tree.wait()
    shared_mib = 64
    assert usage.peak_rss_mib > 3 * shared_mib  # the region once per process mapping it
    assert shared_mib < usage.peak_pss_mib < usage.peak_rss_mib - 1.5 * shared_mib  # once in all
    assert set(usage.peak_pss_by_process_mib) == set(usage.peak_rss_by_process_mib)
