"""The launcher's thread budget on a real server: fold networks run at a count proven to give nnU-Net's bits.

Two fold models whose TorchScript output depends on the thread count (``tests/unit/fake_networks``: a
parallel float32 sum, as oneDNN's convolutions on AVX-512/AMX CPUs) make the default ``auto`` budget's
``split`` candidate (1 thread per fold on 2 CPUs) fail the check, so the server must run them at
nnU-Net's own count; the answers then equal this process's forwards at that count, bit for bit, and
differ from a 1-thread forward. Two elementwise networks keep ``split``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from nnunet_triton import io_names
from nnunet_triton.builder.config_gen import write_config
from nnunet_triton.builder.model_specs import BuildOptions, python_fold_spec
from nnunet_triton.builder.repository import _write_python_model
from nnunet_triton.pipeline import threads
from nnunet_triton.server.thread_budget import available_cpus
from tests.unit.fake_networks import Elementwise, ThreadDependent, save

pytestmark = pytest.mark.skipif(available_cpus().cpus < 2, reason="on 1 CPU nnU-Net's count is 1 thread: "
                                                                  "there is no other budget to refuse")


def _repository(root: Path, network: type) -> tuple[Path, tuple[int, ...], int]:
    from tests.unit.test_model_specs import _config

    config = _config()
    for k in range(2):
        model = root / io_names.fold_model_name(k)
        write_config(python_fold_spec(config, k, BuildOptions()), model)
        _write_python_model(model, "fold_runner", config)  # model.py + inference_config.json, as built
        save(network(config.labels.num_segmentation_heads), model / io_names.VERSION_DIR / "model.pt")
    return root, (config.num_input_channels, *config.patch_size), config.labels.num_segmentation_heads


def _forward(network: torch.nn.Module, tile: np.ndarray, threads: int) -> np.ndarray:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            return network(torch.from_numpy(tile)).numpy()
    finally:
        torch.set_num_threads(before)


def _infer(handle, model: str, tile: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(handle.http_url.removeprefix("http://"))
    try:
        tensor = httpclient.InferInput(io_names.FOLD_INPUT, list(tile.shape), "FP32")
        tensor.set_data_from_numpy(tile)
        return client.infer(model, [tensor]).as_numpy(io_names.FOLD_OUTPUT)
    finally:
        client.close()


def test_a_thread_dependent_network_is_served_at_nnunets_count_bitwise(triton_server, tmp_path: Path) -> None:
    repo, shape, heads = _repository(tmp_path / "repo", ThreadDependent)
    tile = np.random.default_rng(7).standard_normal((1, *shape), dtype=np.float32)
    with triton_server(repo) as handle:
        budget = handle.thread_budget
        assert budget["policy"] == "exact" and budget["exact"] is True
        assert budget["fold_threads"] == budget["nnunet_threads"] >= 2
        assert "split candidate 1 thread(s) NOT bitwise equal" in budget["exactness"]
        served = _infer(handle, io_names.fold_model_name(0), tile)
    network = ThreadDependent(heads)
    at_nnunets = _forward(network, tile, budget["nnunet_threads"])
    np.testing.assert_array_equal(served, at_nnunets)
    assert not np.array_equal(_forward(network, tile, 1), at_nnunets)  # the budget it refused


def test_a_thread_independent_network_keeps_the_split_budget(triton_server, tmp_path: Path) -> None:
    repo, shape, heads = _repository(tmp_path / "repo", Elementwise)
    tile = np.random.default_rng(8).standard_normal((1, *shape), dtype=np.float32)
    with triton_server(repo) as handle:
        budget = handle.thread_budget
        served = _infer(handle, io_names.fold_model_name(1), tile)
    split = available_cpus().cpus // 2
    assert (budget["policy"], budget["fold_threads"], budget["exact"]) == ("split", split, True)
    assert "bitwise equal to nnU-Net's" in budget["exactness"]
    np.testing.assert_array_equal(served, _forward(Elementwise(heads), tile, 1))
    assert threads.nnunet_threads(torch.get_num_threads()) == budget["nnunet_threads"]
