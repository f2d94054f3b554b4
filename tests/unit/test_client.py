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
