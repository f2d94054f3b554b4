"""The release table (``numerics.releases``) and the variants it selects, without the old releases.

The variants are proved against the releases' own code in ``tests/integration/test_release_numerics.py``;
here: the table's names and refusals, that a variant reaches the function it selects (the fold fusion of 2.0
against torch's own float16 statements, the ``inf`` check, the export of float32 logits), the build option
and what the endpoint publishes, and the flat plans format read as nnU-Net 2.3+ reads it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.errors import InputValidationError, NumericalError, UnsupportedModelError
from nnunet_triton.numerics.model_folder import architecture_of_flat_plans, load_inference_config
from nnunet_triton.numerics.releases import DEFAULT_NUMERICS, RELEASES, numerics_names, release_numerics
from nnunet_triton.numerics.sliding_window import FoldAverage, LogitAccumulator, average_folds
from nnunet_triton.numerics.streaming import FoldSlabAverage
from nnunet_triton.parameters import DESCRIPTION_PARAMETER, description_parameters
from tools.fixtures.old_plans import flat_configuration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RESENC = FIXTURES / "Dataset903_SynthMulti" / "nnUNetTrainer__nnUNetResEncUNetMPlans__3d_tiny"
PLAIN = FIXTURES / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny"


def test_the_table_names_every_release_newest_first_and_the_default_is_nnunet_2_8() -> None:
    assert numerics_names() == ("2.8", "2.5", "2.4", "2.3", "2.2.1", "2.2", "2.1", "2.0")
    assert DEFAULT_NUMERICS == "2.8" and release_numerics(None) is RELEASES["2.8"]
    default = release_numerics("2.8")
    assert not (default.divide_each_fold or default.export_float32 or default.labels_from_probabilities)
    assert default.inf_is_error and default.export_spacing_transposed and not default.warnings


@pytest.mark.parametrize("name", ["2.6", "2.8.1", "", "latest"])
def test_an_unknown_release_is_refused_naming_the_choices(name: str) -> None:
    with pytest.raises(InputValidationError, match=r"numerics must be one of \['2.8', '2.5'.*got"):
        release_numerics(name)
    with pytest.raises(ValueError, match="numerics must be one of"):
        BuildOptions(numerics=name)


def test_only_the_releases_with_an_upstream_bug_warn_and_each_warning_names_its_release() -> None:
    warned = {name for name, numerics in RELEASES.items() if numerics.warnings}
    assert warned == {"2.0", "2.1", "2.2", "2.2.1"}
    assert any("2.0" in w and "every fold" in w for w in RELEASES["2.0"].warnings)
    assert any("float16" in w and "1000" in w for w in RELEASES["2.2"].warnings)


def test_two_folds_fused_as_nnunet_2_0_are_its_float16_statements_and_not_the_mean() -> None:
    rng = np.random.default_rng(0)
    folds = [rng.normal(0, 3, (3, 5, 6, 7)).astype(np.float16) for _ in range(3)]
    expected = None
    for fold in folds:  # 2.0's loop: prediction += fold; prediction /= n (on the CPU, float16 tensors)
        t = torch.from_numpy(fold.copy())
        expected = t if expected is None else expected.__iadd__(t)
        expected /= len(folds)
    fused = average_folds(folds, divide_each_fold=True)
    assert fused.dtype == np.float16
    assert np.array_equal(fused, expected.numpy())
    assert not np.array_equal(fused, average_folds(folds))
    on_torch = average_folds([torch.from_numpy(f.copy()) for f in folds], divide_each_fold=True)
    assert torch.equal(on_torch, expected)


def test_slabs_fused_as_nnunet_2_0_equal_the_whole_volume_fusion() -> None:
    rng = np.random.default_rng(1)
    folds = [rng.normal(0, 3, (2, 9, 4, 4)).astype(np.float16) for _ in range(2)]
    slabs: list[np.ndarray] = []
    average = FoldSlabAverage(2, lambda start, slab: slabs.append(slab), divide_each_fold=True)
    for start, stop in ((0, 2), (2, 7), (7, 9)):
        for index, fold in enumerate(folds):
            average.sink(index)(start, fold[:, start:stop])
    whole = FoldAverage(2, divide_each_fold=True)
    for fold in folds:
        whole.add(fold)
    assert np.array_equal(np.concatenate(slabs, axis=1), whole.finalize())


def test_an_inf_in_the_stitched_logits_fails_from_2_3_and_passes_before() -> None:
    def stitched(inf_is_error: bool) -> np.ndarray:
        accumulator = LogitAccumulator(2, (4, 4, 4), (4, 4, 4), use_gaussian=False, inf_is_error=inf_is_error)
        accumulator.add(np.full((2, 4, 4, 4), 70000.0, dtype=np.float32), (slice(0, 4),) * 3)
        return accumulator.finalize()

    with pytest.raises(NumericalError, match="inf"):
        stitched(release_numerics("2.3").inf_is_error)
    assert np.isinf(stitched(release_numerics("2.2.1").inf_is_error)).all()


def test_the_build_option_reaches_the_published_description_with_every_variant() -> None:
    config = replace(_config(PLAIN), numerics="2.0")
    described = json.loads(description_parameters(config)[DESCRIPTION_PARAMETER])["numerics"]
    assert described == {"numerics": "2.0", "releases": "2.0", "gaussian": RELEASES["2.0"].gaussian.value,
                         "fold_fusion": "divide after every fold", "export_dtype": "float32",
                         "labels_from": "probabilities", "inf": "passes", "export_spacing": "reader order"}
    assert BuildOptions().numerics == "2.8" and BuildOptions(numerics="2.2.1").numerics == "2.2.1"
    with pytest.raises(InputValidationError, match="numerics must be one of"):
        replace(config, numerics="3.0")


def _config(folder: Path, plans: dict | None = None) -> object:
    plans = plans or json.loads((folder / "plans.json").read_text())
    dataset = json.loads((folder / "dataset.json").read_text())
    return load_inference_config(plans, dataset, "3d_tiny", trainer_name="nnUNetTrainer",
                                 mirror_axes=(0, 1, 2), folds=(0,))


@pytest.mark.parametrize("folder", [PLAIN, RESENC], ids=["PlainConvUNet", "ResidualEncoderUNet"])
def test_plans_in_the_flat_format_read_as_the_architecture_they_were_made_from(folder: Path,
                                                                                tmp_path: Path) -> None:
    from nnunet_triton.builder.fold_network import load_fold_network
    from tools.fixtures.old_plans import write_flat_model_folder

    plans = json.loads((folder / "plans.json").read_text())
    flat = copy.deepcopy(plans)
    flat["configurations"] = {name: flat_configuration(c, name) for name, c in flat["configurations"].items()}
    assert all("architecture" not in c for c in flat["configurations"].values())
    assert _config(folder, flat) == _config(folder, plans)
    # and the builder rebuilds the same network with the same weights (ResEnc: where 2.0-2.2 imported it)
    old = load_fold_network(write_flat_model_folder(folder, tmp_path / folder.name), 0).network
    new = load_fold_network(folder, 0).network
    assert type(old) is type(new)
    channels = _config(folder, plans).network.num_input_channels
    x = torch.from_numpy(np.random.default_rng(2).normal(size=(1, channels, 16, 32, 32)).astype(np.float32))
    with torch.inference_mode():
        assert torch.equal(old(x), new(x))


def test_flat_plans_naming_an_unknown_network_or_missing_a_key_are_refused_naming_it() -> None:
    flat = flat_configuration(json.loads((PLAIN / "plans.json").read_text())["configurations"]["3d_fullres"],
                              "3d_fullres")
    with pytest.raises(UnsupportedModelError, match="MyUNet"):
        architecture_of_flat_plans({**flat, "UNet_class_name": "MyUNet"}, "3d_fullres")
    del flat["conv_kernel_sizes"]
    with pytest.raises(UnsupportedModelError, match="conv_kernel_sizes"):
        architecture_of_flat_plans(flat, "3d_fullres")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_labels_from_probabilities_follow_nnunets_softmax_ties_not_the_logits(dtype: str) -> None:
    from nnunet_triton.numerics.plans import LabelSettings
    from nnunet_triton.numerics.prediction_export import apply_inference_nonlin, segmentation_from_logits

    rng = np.random.default_rng(46)
    top = rng.normal(0, 1e-3 if dtype == "float16" else 0.3, (1, 200_000)).astype(dtype)
    logits = np.concatenate([top, np.nextafter(top, top.dtype.type(np.inf)), top - 2])  # one ulp apart
    labels = LabelSettings.from_dataset({"labels": {"background": 0, "a": 1, "b": 2}})
    theirs = torch.softmax(torch.from_numpy(logits).float(), 0).argmax(0).numpy()
    from_logits = segmentation_from_logits(logits, labels)
    assert np.count_nonzero(from_logits != theirs) > 1000  # the rounded ties do move nnU-Net's labels
    mine = segmentation_from_logits(logits, labels, from_probabilities=True)
    # torch's softmax rounds some elements with another exp (by their place in the array): a few ties differ
    assert np.count_nonzero(mine != theirs) <= len(mine) // 1000
    probabilities = apply_inference_nonlin(logits, labels)
    assert np.array_equal(mine, probabilities.argmax(0))
