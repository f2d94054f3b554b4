"""NnunetClient behaviour that needs no server (the rest is in tests/triton/)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nnunet_triton
from nnunet_triton.client.client import NnunetClient, _as_image
from nnunet_triton.errors import ClientError, InputValidationError, NnunetTritonError


def test_segment_refuses_an_unknown_option_before_contacting_the_server():
    with NnunetClient("127.0.0.1:1", timeout_s=1) as client:
        with pytest.raises(TypeError, match="mirorring"):
            client.segment(np.zeros((1, 4, 4, 4), np.float32), (1.0, 1.0, 1.0), mirorring=False)
        with pytest.raises(InputValidationError, match=r"tile_step_size must be in \(0, 1\]"):
            client.segment(np.zeros((1, 4, 4, 4), np.float32), (1.0, 1.0, 1.0), tile_step_size=0)


def test_as_image_casts_to_contiguous_float32_and_adds_channel_axis_when_single_channel():
    image = np.arange(24, dtype=np.int32).reshape(2, 3, 4)  # int32 has no typed endpoint: float32
    result = _as_image(image, 3)
    np.testing.assert_array_equal(result, image[None].astype(np.float32))
    assert result.dtype == np.float32 and result.flags.c_contiguous


def test_as_image_raises_input_validation_error_when_dtype_is_complex():
    with pytest.raises(InputValidationError, match="real numeric dtype, got complex64"):
        _as_image(np.zeros((1, 2, 2, 2), np.complex64), 3)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_segment_raises_client_error_naming_the_url_when_server_is_not_reachable(protocol):
    url = f"127.0.0.1:{_closed_port()}"
    match = rf"Triton server at {protocol}://{url} is not reachable"
    with NnunetClient(url, protocol=protocol, timeout_s=5) as client:
        with pytest.raises(ClientError, match=match) as info:
            client.segment(np.zeros((1, 4, 4, 4), np.float32), (1.0, 1.0, 1.0))
    assert isinstance(info.value, NnunetTritonError)


def test_client_raises_value_error_when_protocol_is_unknown():
    with pytest.raises(ValueError, match=r"protocol must be one of \('http', 'grpc'\), got 'ftp'"):
        NnunetClient("127.0.0.1:1", protocol="ftp")


def test_importing_client_does_not_import_tritonclient():
    code = "import sys, nnunet_triton.client.client; print('tritonclient' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(nnunet_triton.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"


def test_the_endpoint_is_named_by_endpoint_and_version_and_old_spellings_warn():
    assert NnunetClient("127.0.0.1:1").model_name == "nnunet"
    assert NnunetClient("127.0.0.1:1", endpoint="liver", version=2).model_name == "liver__v2"
    assert NnunetClient("127.0.0.1:1", endpoint="liver__v2__fold_0").model_name == "liver__v2__fold_0"
    with pytest.warns(DeprecationWarning, match=r"NnunetClient\(model=...\) is deprecated .* use endpoint="):
        assert NnunetClient("127.0.0.1:1", model="liver", version=3).model_name == "liver__v3"
    with pytest.warns(DeprecationWarning, match=r"NnunetClient\(model_name=...\) is deprecated .* endpoint="):
        assert NnunetClient("127.0.0.1:1", model_name="liver__v1", version=3).model_name == "liver__v1"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="endpoint='liver' and its "
                                                         "deprecated spelling model='lung' disagree"):
        NnunetClient("127.0.0.1:1", endpoint="liver", model="lung")
    from nnunet_triton.client.predictor import TritonPredictor

    assert TritonPredictor(url="127.0.0.1:1", endpoint="liver", version=2).client.model_name == "liver__v2"
    with pytest.warns(DeprecationWarning, match=r"TritonPredictor\(model=...\) is deprecated"):
        assert TritonPredictor(url="127.0.0.1:1", model="liver").client.model_name == "liver"


def test_the_project_calls_its_clients_by_endpoint_not_the_deprecated_spellings():
    import ast

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in sorted([*(root / "src").rglob("*.py"), *(root / "tools").rglob("*.py"),
                        *(root / "tests").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                    in {"NnunetClient", "TritonPredictor"}):
                offenders += [f"{path.relative_to(root)}:{node.lineno}: {k.arg}=" for k in node.keywords
                              if k.arg in {"model", "model_name"} and path != Path(__file__).resolve()]
    assert offenders == []
