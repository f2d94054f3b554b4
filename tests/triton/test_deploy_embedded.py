"""``make deploy`` (``nnunet-triton deploy``, target embedded) on the SynthCT fixture, end to end.

Builds the CPU repository into a tmp dir, starts the embedded server detached with its state under a
tmp ``$NNUNET_TRITON_HOME`` (never the checkout's ``build/triton-home``), segments a fixture case through
the printed HTTP endpoint, re-deploys (no rebuild, same server), then ``undeploy`` stops it. Then the same
folder twice under two names (``--model A A --name liver lung``): one repository, one server, both endpoints
answer with the same segmentation.
``NNUNET_TRITON_DEPLOY_MODEL=<results folder>`` runs it against another model folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from pipeline_support import SYNTHCT, cases, model_dir

pytestmark = pytest.mark.slow


@pytest.fixture
def model() -> Path:
    override = os.environ.get("NNUNET_TRITON_DEPLOY_MODEL")
    return Path(override) if override else model_dir(SYNTHCT)


def _case(model: Path) -> tuple[np.ndarray, tuple[float, ...]]:
    if os.environ.get("NNUNET_TRITON_DEPLOY_MODEL"):
        rng = np.random.default_rng(0)
        return rng.normal(100.0, 20.0, size=(1, 24, 40, 40)).astype(np.float32), (1.0, 1.0, 1.0)
    case = cases(SYNTHCT)[0]
    return case.image, case.spacing


def test_deploy_serves_the_model_and_redeploy_is_a_no_op_until_undeploy(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tritonclient.http as httpclient

    from nnunet_triton.cli import deploy as tool
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.server.handle import ServerHandle

    monkeypatch.setenv("NNUNET_TRITON_HOME", str(tmp_path / "home"))
    argv = ["--model-dir", str(model), "--out", str(tmp_path / "repo"), "--ready-timeout", "600"]
    handle = None
    try:
        assert tool.main(argv) == 0
        first = capsys.readouterr().out
        handle = ServerHandle.from_state_file(tmp_path / "home" / "run" / "server.json")
        http = re.search(r"HTTP\s+http://(\S+)", first).group(1)
        assert http == handle.http_url and "repository built" in first

        client = httpclient.InferenceServerClient(http)
        index = {m["name"]: m.get("state")
                 for m in client.get_model_repository_index(headers=handle.control_headers)}
        client.close()
        models = sorted(p.parent.name for p in (tmp_path / "repo").glob("*/config.pbtxt"))
        assert index == {name: "READY" for name in models}  # explicit mode: every model, BLS callees too

        image, spacing = _case(model)
        with NnunetClient(http) as nnunet:
            result = nnunet.segment(image, spacing, mirroring=False)
        assert (result.segmentation.shape, result.segmentation.dtype) == (image.shape[1:], np.uint8)

        assert tool.main(argv) == 0
        second = capsys.readouterr().out
        assert "up to date (input hash matches)" in second
        assert f"already serving this repository (pid {handle.pid})" in second
    finally:
        assert tool.main(["undeploy"]) == 0
    assert handle is not None and not handle.is_running()


def test_deploy_with_two_names_serves_both_endpoints_from_one_server(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tritonclient.http as httpclient

    from nnunet_triton.cli import deploy as tool
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.registry import read_registry
    from nnunet_triton.server.handle import ServerHandle

    monkeypatch.setenv("NNUNET_TRITON_HOME", str(tmp_path / "home"))
    repo = tmp_path / "repo"
    argv = ["--model-dir", str(model), str(model), "--endpoint", "liver", "lung", "--out", str(repo),
            "--ready-timeout", "600"]
    handle = None
    try:
        assert tool.main(argv) == 0
        printed = capsys.readouterr().out
        handle = ServerHandle.from_state_file(tmp_path / "home" / "run" / "server.json")
        http = re.search(r"HTTP\s+http://(\S+)", printed).group(1)
        assert http == handle.http_url and "2 endpoint(s) on one server" in printed
        for name in ("liver", "lung"):
            assert f"http://{http}/v2/models/{name}" in printed
            assert f"(endpoint {name} version 1)" in printed
        assert sorted(read_registry(repo).endpoints) == ["liver", "lung"]

        client = httpclient.InferenceServerClient(http)
        index = {m["name"]: m.get("state")
                 for m in client.get_model_repository_index(headers=handle.control_headers)}
        client.close()
        models = sorted(p.parent.name for p in repo.glob("*/config.pbtxt"))
        assert index == {name: "READY" for name in models}  # every model of both endpoints
        assert {"liver", "lung", "liver__v1__fold_0", "lung__v1__fold_0"} <= set(index)

        image, spacing = _case(model)
        answers = {}
        for name in ("liver", "lung"):
            with NnunetClient(http, endpoint=name) as nnunet:
                answers[name] = nnunet.segment(image, spacing, mirroring=False).segmentation
        assert answers["liver"].shape == image.shape[1:]
        assert np.array_equal(answers["liver"], answers["lung"])  # the same results folder behind both
    finally:
        assert tool.main(["undeploy"]) == 0
    assert handle is not None and not handle.is_running()
