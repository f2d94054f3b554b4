"""The validation report's HTML page in a real headless browser (Debian's chromium).

chromium is installed with apt when it is missing and this runs as root (about 20 s,
``--no-install-recommends``); elsewhere the test skips, saying why.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from nnunet_triton.options import RequestOptions
from nnunet_triton.validate.report import write_report
from nnunet_triton.validate.run import Thresholds, ValidationResult, run_validation
from tools.ohif import chromium


def _chromium() -> str:
    found = chromium()  # Debian's, installed with apt when missing (tools.ohif)
    if found is None:
        pytest.skip("chromium is not installed and cannot be installed here (needs root and apt-get)")
    return found


class _Job:
    def __init__(self, name: str, image: np.ndarray) -> None:
        self.name, self.image = name, image

    def load(self):
        case = type("Case", (), {"data": self.image, "spacing": (1.0, 1.0, 1.0)})()
        return case, None


class _Reference:
    def __init__(self, answer: np.ndarray) -> None:
        self.map = answer

    def answer(self, case, image, spacing):
        return self.map, None


def test_report_page_loads_in_chromium_with_its_table_and_every_picture_decoded(tmp_path: Path):
    reference = np.zeros((6, 16, 16), np.uint8)
    reference[2:5, 4:12, 4:12] = 1
    endpoint = reference.copy()
    endpoint[3, 4:12, 4:8] = 2  # one case disagrees: one picture, plus the Dice plot
    image = np.random.default_rng(0).standard_normal((1, *reference.shape)).astype(np.float32)
    jobs = [_Job("same", image), _Job("differs", image + 10)]
    result = ValidationResult(title="Validation of a test", options=RequestOptions(), thresholds=Thresholds(),
                              reference_kind="test", deployment={}, total=2)
    run_validation(jobs, lambda img, spacing: (endpoint if img.mean() > 5 else reference, None),
                   _Reference(reference), [(1, "organ"), (2, "lesion")], result, num_channels=1)
    page = write_report(result, tmp_path / "report")["validation.html"]

    dom = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True).stdout
    assert "<title>Validation of a test</title>" in dom
    assert "FAIL (1 of 2 cases)" in dom and dom.count("<tr class=\"fail\">") == 2  # 'differs': 2 labels
    loaded = re.search(r'data-images-loaded="(\d+)"', dom)
    assert loaded is not None, dom[-2000:]
    assert int(loaded.group(1)) == dom.count("<img ") == 2
