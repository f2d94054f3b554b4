"""The GPU check's exact rows run with deterministic cuDNN, and the flags are put back afterwards."""

from __future__ import annotations

import pytest
import torch

from tools.gpu_parity import deterministic_cudnn


def test_exact_rows_run_with_deterministic_cudnn_and_the_previous_flags_come_back_even_after_an_error():
    cudnn = torch.backends.cudnn
    before = cudnn.deterministic, cudnn.benchmark
    cudnn.deterministic, cudnn.benchmark = False, True  # what the timings leave: the autotuner on
    try:
        with pytest.raises(RuntimeError, match="a row failed"), deterministic_cudnn():
            assert (cudnn.deterministic, cudnn.benchmark) == (True, False)
            raise RuntimeError("a row failed")
        assert (cudnn.deterministic, cudnn.benchmark) == (False, True)
    finally:
        cudnn.deterministic, cudnn.benchmark = before
