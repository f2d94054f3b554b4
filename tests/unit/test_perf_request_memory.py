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
