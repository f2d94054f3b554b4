"""Every kind of model in ``Dataset903_SynthMulti`` gives nnU-Net's result through the ``nnunet`` endpoint.

The fixture (``tools/fixtures``, spec ``multi``) is planned and trained by nnU-Net itself: two input
channels (CT -> CTNormalization, MR -> ZScore with ``use_mask_for_norm``), region-based labels with
``regions_class_order`` and an ignore label, and four model folders: 3D PlainConvUNet, 2D PlainConvUNet
(slice-wise on 3D volumes), ResidualEncoderUNet (``nnUNetPlannerResEncM``) and a custom trainer that
overrides ``build_network_architecture`` (``nnUNetTrainerBN``). For each, on the real embedded server:

- SEGMENTATION == ``nnUNetPredictor.predict_single_npy_array`` (identical label maps), mirroring off for
  every held-out case and on for the first;
- PROBABILITIES (sigmoid per region) within 1e-6 of nnU-Net's export.

Postprocessing: the 3D model is served from a copy whose ``crossval_results_folds_0/postprocessing.pkl``
is written with nnU-Net's own ``save_pickle`` of nnU-Net's own function, as ``determine_postprocessing``
writes it when it chooses to act (the fixture's own pkl, determined by nnU-Net on the fold's validation
cases, chose nothing): the endpoint equals ``apply_postprocessing(predict_single_npy_array(...))``, and
``postprocessing=false`` equals the raw prediction, on the held-out cases and on one with a second,
smaller lesion pasted in (so that postprocessing must remove a component).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from pipeline_support import BUILD_ROOT, FIXTURES, cases, reference, shared_server

from nnunet_triton.client.client import NnunetClient

PROBABILITY_TOLERANCE = 1e-6
TIMEOUT_S = 1800.0
MULTI = "Dataset903_SynthMulti"
MODELS = {
    "3d_plain": f"{MULTI}/nnUNetTrainer__nnUNetPlans__3d_tiny",
    "2d_plain": f"{MULTI}/nnUNetTrainer__nnUNetPlans__2d_tiny",
    "3d_resenc_m": f"{MULTI}/nnUNetTrainer__nnUNetResEncUNetMPlans__3d_tiny",
    "3d_custom_trainer_bn": f"{MULTI}/nnUNetTrainerBN__nnUNetPlans__3d_tiny",
}
# What determine_postprocessing writes when both of its stages act: all foreground labels as one mask,
# then one region.
PP_KWARGS = [{"labels_or_regions": [1, 2]}, {"labels_or_regions": (1, 2)}, {"labels_or_regions": 2}]


def _params() -> list:
    params = []
    for kind in MODELS:
        for index in (0, 1):
            for mirroring in ((True, False) if index == 0 else (False,)):
                label = f"{kind}-case{index}-{'mirroring' if mirroring else 'no_mirroring'}"
                params.append(pytest.param(kind, index, mirroring, id=label))
    return params


@pytest.fixture(scope="session")
def session_request(request):
    """The session's request: the shared server's finalizer belongs there, not to one test."""
    return request


@pytest.fixture
def model_server(request, triton_server, session_request):
    """(model key, running server); the shared server is (re)started for this model when needed."""
    kind = request.param
    return MODELS[kind], shared_server(MODELS[kind], triton_server, session_request)


@pytest.mark.parametrize(("model_server", "index", "mirroring"), _params(), indirect=["model_server"])
def test_endpoint_equals_nnunet_for_every_model_kind(model_server, index, mirroring):
    key, server = model_server
    case = cases(key)[index]
    assert case.image.shape[0] == 2  # both channels travel in one IMAGE tensor
    with NnunetClient(server.grpc_url, protocol="grpc", timeout_s=TIMEOUT_S) as client:
        result = client.segment(case.image, case.spacing, mirroring=mirroring, probabilities=True)
    ref = reference(key, case.name, mirroring)
    np.testing.assert_array_equal(result.segmentation, ref.segmentation)
    assert set(np.unique(ref.segmentation)) <= {0, 1, 2}  # regions_class_order values, never the ignore label
    assert result.probabilities.shape == ref.probabilities.shape == (2, *case.image.shape[1:])
    assert float(np.abs(result.probabilities - ref.probabilities).max()) <= PROBABILITY_TOLERANCE


@pytest.fixture(scope="session")
def postprocessing_model() -> str:
    """A copy of the 3D model with a non-empty postprocessing.pkl (see the module docstring)."""
    from batchgenerators.utilities.file_and_folder_operations import save_pickle
    from nnunetv2.postprocessing.remove_connected_components import (
        remove_all_but_largest_component_from_segmentation as largest,
    )

    copy_root = BUILD_ROOT / "model-copies" / f"{MULTI}_postprocessing"
    if copy_root.exists():
        shutil.rmtree(copy_root)
    source = FIXTURES / MODELS["3d_plain"]
    shutil.copytree(source.parent / "imagesTs", copy_root / "imagesTs")
    shutil.copytree(source.parent / "labelsTs", copy_root / "labelsTs")
    model = copy_root / source.name
    shutil.copytree(source, model)
    pp_dir = model / "crossval_results_folds_0"
    pp_dir.mkdir(exist_ok=True)
    save_pickle(([largest] * len(PP_KWARGS), PP_KWARGS), str(pp_dir / "postprocessing.pkl"))
    return str(model)


@pytest.fixture
def postprocessing_server(postprocessing_model, triton_server, session_request):
    return postprocessing_model, shared_server(postprocessing_model, triton_server, session_request)


def _with_second_smaller_lesion(case):
    """The case with a copy of part of its lesion pasted elsewhere in the body: two lesion components of
    different sizes, so nnU-Net's largest-component postprocessing must remove one."""
    image = case.image.copy()
    zs, ys, xs = np.nonzero(case.label == 2)
    lo = np.array([zs.min(), ys.min(), xs.min()])
    size = np.maximum((np.array([zs.max(), ys.max(), xs.max()]) - lo + 1) * 2 // 3, 2)
    block = image[:, lo[0]:lo[0] + size[0], lo[1]:lo[1] + size[1], lo[2]:lo[2] + size[2]].copy()
    body = np.argwhere((case.label == 0) & (case.image[0] > -500))
    far = body[np.argmax(np.abs(body - lo).sum(axis=1))]
    dst = np.clip(far - size // 2, 0, np.array(image.shape[1:]) - size)
    image[:, dst[0]:dst[0] + size[0], dst[1]:dst[1] + size[1], dst[2]:dst[2] + size[2]] = block
    return image


@pytest.mark.parametrize("variant", ["held_out_0", "held_out_1", "second_smaller_lesion"])
def test_endpoint_applies_nnunet_postprocessing_unless_the_request_turns_it_off(
    postprocessing_server, variant
):
    from nnunetv2.postprocessing.remove_connected_components import (
        apply_postprocessing,
    )
    from nnunetv2.postprocessing.remove_connected_components import (
        remove_all_but_largest_component_from_segmentation as largest,
    )
    from pipeline_support import predictor

    key, server = postprocessing_server
    case = cases(key)[1 if variant == "held_out_1" else 0]
    image = _with_second_smaller_lesion(case) if variant == "second_smaller_lesion" else case.image
    nnunet = predictor(key, None, False)
    raw_expected = nnunet.predict_single_npy_array(image, {"spacing": list(case.spacing)})
    expected = apply_postprocessing(raw_expected, [largest] * len(PP_KWARGS), PP_KWARGS)
    with NnunetClient(server.grpc_url, protocol="grpc", timeout_s=TIMEOUT_S) as client:
        processed = client.segment(image, case.spacing, mirroring=False)
        raw = client.segment(image, case.spacing, mirroring=False, postprocessing=False)
    np.testing.assert_array_equal(raw.segmentation, raw_expected)
    np.testing.assert_array_equal(processed.segmentation, expected)
    if variant == "second_smaller_lesion":
        assert int((raw_expected != expected).sum()) > 0, "postprocessing removed nothing: weak test"


def test_2d_model_segments_a_true_2d_image_like_nnunet(triton_server, session_request):
    """A 2D image as nnU-Net's ``NaturalImage2DIO`` presents it: ``(C, 1, X, Y)``, spacing ``(999, 1, 1)``."""
    from pipeline_support import predictor

    key = MODELS["2d_plain"]
    server = shared_server(key, triton_server, session_request)
    volume = cases(key)[0]
    middle = volume.image.shape[1] // 2
    image = np.ascontiguousarray(volume.image[:, middle:middle + 1])
    spacing = (999.0, 1.0, 1.0)
    expected = predictor(key, None, False).predict_single_npy_array(image, {"spacing": list(spacing)})
    with NnunetClient(server.grpc_url, protocol="grpc", timeout_s=TIMEOUT_S) as client:
        result = client.segment(image, spacing, mirroring=False)
    assert result.segmentation.shape == image.shape[1:]
    np.testing.assert_array_equal(result.segmentation, expected)
    assert expected.any()


def test_cli_writes_postprocessed_segmentations_unless_disable_postprocessing(
    postprocessing_server, tmp_path
):
    import os
    import subprocess
    import sys

    import SimpleITK as sitk
    from nnunetv2.postprocessing.remove_connected_components import apply_postprocessing
    from nnunetv2.postprocessing.remove_connected_components import (
        remove_all_but_largest_component_from_segmentation as largest,
    )
    from pipeline_support import REPO_ROOT, predictor

    key, server = postprocessing_server
    case = cases(key)[0]
    image = _with_second_smaller_lesion(case)
    reference = sitk.ReadImage(str(FIXTURES / MULTI / "imagesTs" / f"{case.name}_0000.nii.gz"))
    (tmp_path / "in").mkdir()
    for channel in range(image.shape[0]):
        written = sitk.GetImageFromArray(image[channel])
        written.CopyInformation(reference)
        sitk.WriteImage(written, str(tmp_path / "in" / f"{case.name}_{channel:04d}.nii.gz"))
    raw = predictor(key, None, False).predict_single_npy_array(image, {"spacing": list(case.spacing)})
    python_path = os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path}
    expected_pp = apply_postprocessing(raw, [largest] * len(PP_KWARGS), PP_KWARGS)
    for out, flags, expected in (("pp", [], expected_pp), ("raw", ["--disable-postprocessing"], raw)):
        command = [sys.executable, "-m", "nnunet_triton.cli", "predict", "--url", server.http_url,
                   "-i", str(tmp_path / "in"), "-o", str(tmp_path / out), "--disable-tta", *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
        assert result.returncode == 0, result.stderr
        written = sitk.GetArrayFromImage(sitk.ReadImage(str(tmp_path / out / f"{case.name}.nii.gz")))
        np.testing.assert_array_equal(written, expected)
    # validate --model applies the postprocessing the endpoint publishes as deployed (nnU-Net's own function),
    # so the postprocessed answer passes exactly; before, nnU-Net's raw prediction was the reference
    from nnunet_triton import cli

    assert (raw != expected_pp).any()
    report = tmp_path / "report"
    assert cli.main(["validate", "--model-dir", key, "-i", str(tmp_path / "in"), "--url", server.http_url,
                     "--no-mirroring", "--exact", "--report", str(report)]) == 0
    assert cli.main(["validate", "--model-dir", key, "-i", str(tmp_path / "in"), "--url", server.http_url,
                     "--no-mirroring", "--exact", "--no-postprocessing", "--report", str(report)]) == 0
