"""The builder refuses to export fold models the serving libtorch may not load, and records both versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nnunet_triton.builder.model_specs import BuildOptions, FoldRunner
from nnunet_triton.builder.repository import build_repository
from nnunet_triton.builder.torch_compat import check_export_torch, torch_minor, torch_minor_text
from nnunet_triton.errors import ConfigParameterError, ExportError
from nnunet_triton.registry import version_metadata

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "Dataset901_SynthCT" / \
    "nnUNetTrainer__nnUNetPlans__3d_tiny"


def test_check_export_torch_refuses_naming_both_versions_and_the_ways_out_when_export_torch_is_newer():
    with pytest.raises(ExportError) as info:
        check_export_torch("2.14.1+cu130", "2.5", runner="libtorch")
    message = str(info.value)
    for text in ("torch 2.5", "2.14.1+cu130", "newer", "nnunet-triton deploy --target docker",
                 "--serving-torch"):
        assert text in message


@pytest.mark.parametrize("export_torch", ["2.5.1", "2.5.0a0+e000cf0ad9.nv24.10", "2.4.0", "1.13.1"])
def test_check_export_torch_accepts_when_export_torch_is_not_newer(export_torch):
    check_export_torch(export_torch, "2.5", runner="libtorch")
    check_export_torch("9.9", None, runner="python")  # None: the serving environment's own torch


def test_build_options_name_the_loading_torch_per_runner_when_serving_torch_is_unset_or_given():
    assert BuildOptions(target="gpu").loading_torch == "2.14"  # tritonserver 26.09's libtorch (the gpu image)
    assert BuildOptions(target="gpu", fold_runner=FoldRunner.PYTHON).loading_torch is None
    assert BuildOptions().loading_torch is None
    assert BuildOptions(target="gpu", serving_torch="2.6.0a0+ecf3bae").loading_torch == "2.6"
    with pytest.raises(ConfigParameterError, match="not of the form MAJOR.MINOR"):
        BuildOptions(serving_torch="latest")


def test_gpu_build_is_refused_before_anything_is_written_when_this_torch_is_newer_than_libtorch(tmp_path):
    if torch_minor(torch.__version__) <= (2, 14):
        pytest.skip(f"this torch ({torch.__version__}) is not newer than tritonserver 26.09's libtorch")
    out = tmp_path / "repo"
    with pytest.raises(ExportError, match="nnunet-triton deploy --target docker"):
        build_repository(FIXTURE, out, options=BuildOptions(target="gpu"))
    assert not out.exists()


def test_gpu_build_records_exporting_and_serving_torch_when_serving_torch_matches(tmp_path):
    serving = torch_minor_text(torch.__version__)
    options = BuildOptions(target="gpu", serving_torch=serving)
    result = build_repository(FIXTURE, tmp_path / "repo", options=options, folds_only=True)
    metadata = version_metadata(result.out)
    assert (metadata["torch_version"], metadata["serving_torch"], metadata["fold_runner"]) == (
        torch.__version__, serving, "libtorch")
    assert all(e["torch_version"] == torch.__version__ for e in metadata["exports"])
