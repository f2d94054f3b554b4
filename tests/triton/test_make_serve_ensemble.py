"""``make serve MODEL="A B"`` really builds and serves the ensemble, and it equals ``nnUNetv2_ensemble``.

Runs make itself (the recursive ``make repository`` included) with its own server home, ports and
repository, then ``make status`` (which shows the thread budget) and ``make stop``. The reference is
nnU-Net's ensemble of the two members' probabilities (test_configuration_ensemble.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import numpy as np
import pytest
from pipeline_support import FIXTURES, REPO_ROOT, cases
from test_configuration_ensemble import MEMBERS, _nnunet_ensemble

from nnunet_triton.client.client import NnunetClient
from tests.fixture_paths import require_fixture


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _make(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO_ROOT), *args], capture_output=True,
                          text=True, timeout=1800, env=env, check=False)


def test_make_serve_refuses_a_repository_path_with_a_space_before_starting(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed")
    (tmp_path / "my repo").mkdir()
    env = {**os.environ, "NNUNET_TRITON_HOME": str(tmp_path / "home"), "MAKEFLAGS": ""}
    served = _make("serve", f"MODEL_REPOSITORY={tmp_path / 'my repo'}", env=env)
    assert served.returncode != 0
    assert "model_repository must not contain whitespace" in served.stderr and "my repo" in served.stderr


def test_make_serve_with_two_models_serves_nnunets_ensemble(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed")
    for member in MEMBERS:
        require_fixture(FIXTURES / member / "plans.json")
    env = {**os.environ, "NNUNET_TRITON_HOME": str(tmp_path / "home"), "MAKEFLAGS": ""}
    ports = {name: _free_port() for name in ("HTTP", "GRPC", "METRICS")}
    variables = [f"MODEL={' '.join(str(FIXTURES / m) for m in MEMBERS)}",
                 f"MODEL_REPOSITORY={tmp_path / 'ensemble_repo'}",
                 *(f"TRITON_{name}_PORT={port}" for name, port in ports.items())]
    served = _make("serve", *variables, env=env)
    try:
        assert served.returncode == 0, served.stdout + served.stderr
        assert (tmp_path / "ensemble_repo" / "member1_preprocess_model").is_dir()  # both members built
        status = _make("status", env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        state = json.loads(status.stdout[status.stdout.index("{"):])
        assert state["thread_budget"]["fold_instances"] == 2 and state["thread_budget"]["reason"]
        case = cases(MEMBERS[0])[0]
        expected, _ = _nnunet_ensemble(case.image, case.spacing, False, tmp_path)
        with NnunetClient(f"127.0.0.1:{ports['HTTP']}", timeout_s=1800) as client:
            result = client.segment(case.image, case.spacing, mirroring=False)
        np.testing.assert_array_equal(result.segmentation, expected)
    finally:
        stopped = _make("stop", env=env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
