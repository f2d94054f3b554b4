"""Fixtures shared by the unit tests."""

from __future__ import annotations

from typing import Any

import pytest
from parity_support import xp_from_param


@pytest.fixture(params=["numpy", "cupy"])
def xp(request: pytest.FixtureRequest) -> Any:
    """The array backend of a numerics test: NumPy, and CuPy where a usable GPU answers (else skipped)."""
    return xp_from_param(request.param)
