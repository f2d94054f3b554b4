"""Shared pytest fixtures: the embedded Triton server factory and a tiny identity model repository.

Everything under ``tests/triton/`` is marked ``triton`` automatically (``-m "not triton"`` skips it);
tests marked ``gpu`` are skipped on machines without an NVIDIA driver. Every DICOM-SEG and RTSTRUCT a test
writes below its ``tmp_path`` is validated by dciodvfy when the test ends (``tests/dciodvfy_support.py``;
``@pytest.mark.dciodvfy_allows({...})`` names and explains a warning a test expects).

Typical use in a test module::

    @pytest.fixture(scope="module")
    def server(triton_server, tmp_path_factory):
        repo = build_my_repository(tmp_path_factory.mktemp("repo"))
        with triton_server(repo) as handle:   # free loopback ports, logs in a tmp dir
            yield handle                      # handle.http_url, handle.grpc_url, handle.metrics_url
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TRITON_TESTS = REPO_ROOT / "tests" / "triton"

# The identity model echoes every input by DLPack (as every model of the project passes tensors,
# serving.tensors); STUB_ENV reports the stub's numpy and sys.prefix as UINT8 JSON bytes, which proves the
# stub runs with this venv (numpy 2) and not some other Python. ``identity_numpy_api`` echoes the same
# inputs through the stub's NumPy C API (``as_numpy``/``Tensor(name, ndarray)``), the route the models
# avoid: tests/triton/test_embedded_server.py shows what it does to tensors under numpy 2.
IDENTITY_MODEL = "identity"
NUMPY_API_MODEL = "identity_numpy_api"
IDENTITY_TENSORS = (("INPUT_FP32", "OUTPUT_FP32", "FP32"), ("INPUT_INT16", "OUTPUT_INT16", "INT16"))
IDENTITY_MODEL_PY = textwrap.dedent(
    """
    import json
    import sys

    import numpy as np
    import triton_python_backend_utils as pb_utils

    PAIRS = {pairs!r}
    NUMPY_API = {numpy_api!r}


    def echo(name, tensor):
        if NUMPY_API:
            return pb_utils.Tensor(name, tensor.as_numpy())
        return pb_utils.Tensor.from_dlpack(name, tensor)


    class TritonPythonModel:
        def execute(self, requests):
            env = json.dumps({{"numpy": np.__version__, "prefix": sys.prefix}}).encode()
            responses = []
            for request in requests:
                outputs = [echo(out_name, pb_utils.get_input_tensor_by_name(request, in_name))
                           for in_name, out_name in PAIRS]
                outputs.append(pb_utils.Tensor.from_dlpack("STUB_ENV", np.frombuffer(env, np.uint8).copy()))
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
            return responses
    """
)


@pytest.fixture(autouse=True)
def _dciodvfy_on_written_objects(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that has a ``tmp_path``: dciodvfy finds no error and no unexplained warning in any
    DICOM-SEG or RTSTRUCT below it."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    root = request.getfixturevalue("tmp_path")  # torn down after this fixture: still there below
    yield
    from tests.dciodvfy_support import check_written_objects

    marker = request.node.get_closest_marker("dciodvfy_allows")
    check_written_objects(root, dict(marker.args[0]) if marker else None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_gpu = shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (no nvidia-smi or /dev/nvidia0 here)")
    for item in items:
        if TRITON_TESTS in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.triton)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


def write_identity_repository(root: Path) -> Path:
    """Write ``<root>/identity`` and ``<root>/identity_numpy_api`` (Python backend, config.pbtxt from
    config_gen) and return ``root``."""
    from nnunet_triton.builder import config_gen

    tensors = [
        (config_gen.TensorSpec(i, dt, (-1, -1, -1)), config_gen.TensorSpec(o, dt, (-1, -1, -1)))
        for i, o, dt in IDENTITY_TENSORS
    ]
    pairs = tuple((i, o) for i, o, _ in IDENTITY_TENSORS)
    for name, numpy_api in ((IDENTITY_MODEL, False), (NUMPY_API_MODEL, True)):
        spec = config_gen.ModelSpec(
            name=name,
            backend="python",
            max_batch_size=0,
            inputs=tuple(i for i, _ in tensors),
            outputs=(*(o for _, o in tensors), config_gen.TensorSpec("STUB_ENV", "UINT8", (-1,))),
            instance_groups=(config_gen.InstanceGroup(count=1, kind="cpu"),),
        )
        model_dir = root / name
        config_gen.write_config(spec, model_dir)
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "1" / "model.py").write_text(IDENTITY_MODEL_PY.format(pairs=pairs, numpy_api=numpy_api))
    return root


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """Factory ``triton_server(model_repository, **start_kwargs)`` -> context manager yielding a ServerHandle.

    The server binds to 127.0.0.1 on free ports, logs to a fresh tmp dir and is stopped on exit.
    The prepared binary tree is shared: ``$NNUNET_TRITON_HOME`` or ``build/triton-home``.
    """
    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton (which ships tritonserver) is not installed; run `make setup`")
    from nnunet_triton.server import embedded as embedded_server
    from nnunet_triton.server.handle import ServerHandle

    @contextlib.contextmanager
    def start(model_repository: str | Path, **kwargs: Any) -> Iterator[ServerHandle]:
        run_dir = tmp_path_factory.mktemp("triton-run")
        kwargs.setdefault("home", os.environ.get("NNUNET_TRITON_HOME", REPO_ROOT / "build" / "triton-home"))
        kwargs.setdefault("log_file", run_dir / "tritonserver.log")
        kwargs.setdefault("pid_file", run_dir / "tritonserver.pid")
        kwargs.setdefault("state_file", run_dir / "server.json")
        kwargs.setdefault("ready_timeout_s", 300.0)
        kwargs.setdefault("exit_timeout_s", 5)
        handle = embedded_server.start(model_repository, **kwargs)
        try:
            yield handle
        finally:
            handle.stop()

    return start


@pytest.fixture(scope="session")
def identity_model_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository with the ``identity`` models (FP32 and INT16 echo, rank-3 variable shapes)."""
    return write_identity_repository(tmp_path_factory.mktemp("identity-repo"))


@pytest.fixture(scope="session")
def identity_server(triton_server: Callable[..., Any], identity_model_repository: Path) -> Iterator[Any]:
    """One embedded server with the identity model, shared by the whole session."""
    with triton_server(identity_model_repository) as handle:
        yield handle


@pytest.fixture(params=["numpy", "cupy"])
def xp(request: pytest.FixtureRequest) -> Any:
    """The array backend of a numerics test: NumPy, and CuPy where a usable GPU answers (else skipped).

    One fixture for every numerics test module (tests/unit/parity_support.py decides whether CuPy can run).
    """
    from tests.unit.parity_support import xp_from_param

    return xp_from_param(request.param)
