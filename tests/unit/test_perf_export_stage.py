"""The export-stage benchmark measures what it says: each variant's labels against nnU-Net's, a peak that
grows with the work, a table with one row per variant, and cases refused when malformed."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tests.fixture_paths import SYNTH_CT, require_fixture
from tools.perf import export_stage


def test_a_case_is_a_fixture_and_a_positive_slice_count():
    assert export_stage.parse_case("manyclass:100") == ("manyclass", 100)
    for bad in ("manyclass", "synthct:0", "liver:10", "synthct:ten"):
        with pytest.raises(argparse.ArgumentTypeError, match="synthct:N or manyclass:N"):
            export_stage.parse_case(bad)


def test_each_variant_gives_nnunets_labels_and_reports_its_time_and_memory(tmp_path):
    require_fixture(SYNTH_CT.model_dir / "plans.json")
    rows = {v: export_stage._child(v, "synthct", 2, tmp_path / f"{v}.npy") for v in ("nnunet", "rows-N")}
    reference = np.load(tmp_path / "nnunet.npy")
    assert reference.shape == (2, 512, 512) and len(np.unique(reference)) == rows["nnunet"]["heads"]
    assert np.load(tmp_path / "rows-N.npy").tobytes() == reference.tobytes()
    for row in rows.values():
        # the resampled logits (3 x 2 x 512 x 512 float16 = 3 MiB) at least pass through memory
        assert row["seconds"] > 0 and row["peak_above_before_mib"] >= 1.0
        assert row["output_shape"] == [2, 512, 512] and row["logits_shape"][1:] == [374, 374]


def test_the_table_has_one_row_per_variant_and_says_when_labels_differ():
    row = {"variant": "rows-N", "threads": 2, "seconds": 1.0, "peak_above_before_mib": 10.0,
           "logits_mib": 5.0, "heads": 3, "speedup_vs_nnunet": 2.5, "memory_vs_nnunet": 0.2,
           "labels_equal_nnunet": False}
    result = {"date": "today", "cpu": "cpu", "cpus": 2, "load_before": (0.5, 0, 0), "load_after": (1.0, 0, 0),
              "cases": [{"model": "synthct", "slices": 3, "rows": [dict(row, variant="nnunet",
                                                                          labels_equal_nnunet=True), row]}]}
    text = export_stage.markdown(result)
    assert "load average 0.50 before and 1.00 after" in text
    assert text.count("| synthct, N=3 |") == 2 and "| rows-N | 2 | 1.0 | 2.5x | 10.0 | 0.2x | NO |" in text
