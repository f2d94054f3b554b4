"""network_models.export: TorchScript export of a fold, checked against nnU-Net's own predictor network.

Uses the tiny fixture model (``tests/fixtures/Dataset901_SynthCT/...``) or ``$NNUNET_TRITON_TEST_MODEL``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from nnunet_triton.builder import fold_network
from nnunet_triton.builder import torchscript as export
from nnunet_triton.cli import export as torchscript_cli
from nnunet_triton.errors import ExportError, UnsupportedModelError
from nnunet_triton.pipeline.fold_runner import load_runner
from nnunet_triton.validate.oracle import nnunet_predictor
from tests.fixture_paths import require_fixture

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get(
    "NNUNET_TRITON_TEST_MODEL",
    REPO_ROOT / "tests" / "fixtures" / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny",
))


@pytest.fixture(autouse=True)
def _committed_fixture() -> None:
    require_fixture(MODEL_DIR / "plans.json")


def _nnunet_network(fold: int) -> torch.nn.Module:
    """The network exactly as nnUNetPredictor builds and loads it."""
    return nnunet_predictor(MODEL_DIR, folds=(fold,)).network.eval()


def _inputs(batch_size: int, sample_shape: tuple[int, ...], seed: int = 7) -> torch.Tensor:
    return torch.randn((batch_size, *sample_shape), generator=torch.Generator().manual_seed(seed))


def _load(path: str | Path) -> torch.jit.ScriptModule:
    return export._load_traced(Path(path), "cpu")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> export.ExportResult:
    return export.export_fold(MODEL_DIR, 0, tmp_path_factory.mktemp("export") / "model.pt")


def test_export_reports_exact_match_at_every_batch_size_when_cpu_fp32(exported: export.ExportResult) -> None:
    assert exported.max_abs_diff == ((2, 0.0), (1, 0.0), (3, 0.0))
    assert (exported.precision, exported.device, exported.output_dtype) == ("fp32", "cpu", "float32")
    assert exported.tolerance_abs == 0.0
    assert exported.torch_version == torch.__version__
    assert exported.sha256 == export.sha256_file(Path(exported.path))
    assert not list(Path(exported.path).parent.glob(".*partial"))


def test_exported_file_equals_nnunet_predictor_network_bitwise_when_batch_is_1(
    exported: export.ExportResult,
) -> None:
    network, traced = _nnunet_network(0), _load(exported.path)
    x = _inputs(1, exported.input_shape)
    with torch.inference_mode():
        expected, actual = network(x), traced(x)
    assert actual.shape == (1, *exported.output_shape)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("batch_size", [1, 4, 5])
def test_exported_file_equals_eager_at_same_batch_size_when_traced_at_two(
    exported: export.ExportResult, batch_size: int
) -> None:
    network, traced = _nnunet_network(0), _load(exported.path)
    x = _inputs(batch_size, exported.input_shape, seed=batch_size)
    with torch.inference_mode():
        assert torch.equal(traced(x), network(x))


def test_batch_of_n_matches_n_single_calls_only_to_float_rounding_unless_run_one_by_one(
    exported: export.ExportResult,
) -> None:
    """oneDNN vs native convolutions are chosen by input size, so batch N may round differently.

    Measured on the 3d_tiny fixture: max |batched - singles| ~6e-6 (fp32 logits of magnitude ~1);
    the runner with ``max_forward_batch=1`` reproduces nnU-Net's one-tile forwards exactly.
    """
    network = _nnunet_network(0)
    x = _inputs(4, exported.input_shape, seed=11)
    with torch.inference_mode():
        singles = torch.cat([network(x[i:i + 1]) for i in range(4)])
    batched = load_runner(exported.path).run([x])[0]
    one_by_one = load_runner(exported.path, max_forward_batch=1).run([x[:3], x[3:]])
    scale = float(singles.abs().max())
    assert float((batched - singles).abs().max()) <= 1e-5 * max(1.0, scale)
    assert torch.equal(torch.cat(one_by_one), singles)
    assert exported.batch_vs_single_max_abs_diff <= 1e-5 * max(1.0, scale)


def test_export_refuses_to_write_when_reloaded_file_differs(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    original = export._load_traced

    class Perturbed(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x) + 1e-4

    monkeypatch.setattr(export, "_load_traced", lambda path, device: Perturbed(original(path, device)))
    out = tmp_path / "model.pt"
    with pytest.raises(ExportError, match=r"fold 0: reloaded TorchScript differs .* by 0\.0001.*refusing"):
        export.export_fold(MODEL_DIR, 0, out)
    assert list(tmp_path.iterdir()) == []


def test_export_accepts_difference_within_a_given_tolerance(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    original = export._load_traced
    monkeypatch.setattr(export, "_load_traced",
                        lambda path, device: _Offset(original(path, device), 1e-6))
    result = export.export_fold(MODEL_DIR, 0, tmp_path / "model.pt",
                                options=export.ExportOptions(tolerance=1e-5))
    assert all(0 < diff <= result.tolerance_abs for _, diff in result.max_abs_diff)
    assert (tmp_path / "model.pt").is_file()


class _Offset(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, offset: float) -> None:
        super().__init__()
        self.module, self.offset = module, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) + self.offset


def test_export_raises_unsupported_model_error_naming_trainer_when_trainer_is_unknown(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model, ignore=shutil.ignore_patterns("fold_[1-9]*"))
    checkpoint_path = model / "fold_0" / "checkpoint_final.pth"
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    checkpoint["trainer_name"] = "nnUNetTrainerThatDoesNotExist"
    torch.save(checkpoint, checkpoint_path)
    with pytest.raises(UnsupportedModelError, match="trainer 'nnUNetTrainerThatDoesNotExist'"):
        export.export_fold(model, 0, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "fp16"}, "needs device 'cuda'"),
        ({"precision": "int8"}, "precision must be one of"),
        ({"trace_batch_size": 1}, "trace_batch_size must be >= 2"),
    ],
)
def test_export_options_raise_when_invalid(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        export.ExportOptions(**kwargs)


def test_export_cli_writes_model_files_and_metadata_when_given_folds(tmp_path: Path) -> None:
    assert torchscript_cli.main(["--model-dir", str(MODEL_DIR), "--folds", "0", "--out", str(tmp_path)]) == 0
    metadata = json.loads((tmp_path / "export_metadata.json").read_text())
    assert [(m["fold"], Path(m["path"]).name, m["max_abs_diff"]) for m in metadata] == [
        (0, "fold_0.pt", [[2, 0.0], [1, 0.0], [3, 0.0]])
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export_metadata.json", "fold_0.pt"]


@pytest.mark.gpu
def test_export_fp16_matches_nnunet_autocast_network_when_cuda(tmp_path: Path) -> None:
    """fp16: traced under CUDA autocast like nnU-Net's predictor; FP32 in, FP16 out."""
    result = export.export_fold(MODEL_DIR, 0, tmp_path / "model.pt",
                                options=export.ExportOptions(precision="fp16", device="cuda"))
    assert result.output_dtype == "float16"
    network = _nnunet_network(0).cuda()
    traced = export._load_traced(tmp_path / "model.pt", "cuda")
    x = _inputs(2, result.input_shape).cuda()
    with torch.inference_mode():
        with torch.autocast("cuda", dtype=torch.float16):
            expected = network(x)
        actual = traced(x)
    assert actual.dtype == torch.float16
    assert float((actual.float() - expected.float()).abs().max()) <= result.tolerance_abs


def test_smallest_input_is_twice_the_total_downsampling_capped_at_the_patch() -> None:
    strides = [[1, 1, 1], [2, 2, 2], [2, 2, 2], [2, 2, 1]]
    assert fold_network.smallest_input((24, 32, 32), strides) == (16, 16, 8)
    assert fold_network.smallest_input((112, 160, 128), [[1, 1, 1], *[[2, 2, 2]] * 5]) == (64, 64, 64)
    assert fold_network.smallest_input((8, 12), [[2, 2], [2, 2], [2, 2]]) == (8, 12)  # never above the patch
    assert fold_network.smallest_input((24, 32), None) == (24, 32)


def test_quick_export_checks_the_small_input_and_once_at_the_patch(exported: export.ExportResult) -> None:
    network = fold_network.load_fold_network(MODEL_DIR, 0)
    assert exported.check_shape == (network.num_input_channels, *network.smallest_input)
    assert exported.check_shape != exported.input_shape  # the checks really ran on a smaller input
    assert exported.patch_max_abs_diff == 0.0
    assert exported.output_shape[1:] == network.patch_size


def test_export_falls_back_to_the_patch_size_when_the_small_trace_does_not_generalise(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fails(*args, **kwargs):
        raise ExportError("does not generalise")

    monkeypatch.setattr(export, "_check_patch", fails)
    result = export.export_fold(MODEL_DIR, 0, tmp_path / "model.pt")
    assert result.check_shape == result.input_shape and result.patch_max_abs_diff is None
    assert result.max_abs_diff == ((2, 0.0), (1, 0.0), (3, 0.0))


def test_folds_with_identical_checkpoints_are_exported_once(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("plans.json", "dataset.json"):
        shutil.copy(MODEL_DIR / name, model / name)
    for fold in (0, 1):
        (model / f"fold_{fold}").mkdir()
        shutil.copy(MODEL_DIR / "fold_0" / "checkpoint_final.pth",
                    model / f"fold_{fold}" / "checkpoint_final.pth")
    first, second = export.export_folds(model, (0, 1), tmp_path / "out")
    assert (first.reused_from, second.reused_from) == (None, 0)
    assert Path(second.path).read_bytes() == Path(first.path).read_bytes()
    other = export.export_folds(MODEL_DIR, (0, 1), tmp_path / "distinct")  # different weights: both traced
    assert [r.reused_from for r in other] == [None, None]
