"""``TritonPredictor`` gives what ``nnUNetPredictor`` gives, through the embedded server (SynthCT fixture)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import SimpleITK as sitk
from pipeline_support import SYNTHCT, cases, model_dir, reference, shared_server

from nnunet_triton.client.predictor import TritonPredictor
from nnunet_triton.errors import UnsupportedModelError

PROBABILITY_TOLERANCE = 1e-6  # float32 exp on the server vs torch's (test_pipeline_parity)


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


def _predictor(server, **kwargs) -> TritonPredictor:
    predictor = TritonPredictor(url=server.http_url, allow_tqdm=False, **kwargs)
    predictor.initialize_from_trained_model_folder(str(model_dir(SYNTHCT)), use_folds=None)
    return predictor


@pytest.mark.parametrize("mirroring", [False, True], ids=["no_mirroring", "mirroring"])
def test_predict_single_npy_array_equals_nnunet_predictor(server, mirroring):
    predictor = _predictor(server, use_mirroring=mirroring)
    # Every case without mirroring; with mirroring (8x the network calls on 2 CPU cores) the first case.
    for case in cases(SYNTHCT) if not mirroring else cases(SYNTHCT)[:1]:
        segmentation = predictor.predict_single_npy_array(case.image, {"spacing": list(case.spacing)})
        expected = reference(SYNTHCT, case.name, mirroring).segmentation
        assert segmentation.dtype == expected.dtype
        np.testing.assert_array_equal(segmentation, expected)


def test_predict_single_npy_array_returns_probabilities_like_nnunet(server):
    case = cases(SYNTHCT)[0]
    segmentation, probabilities = _predictor(server, use_mirroring=False).predict_single_npy_array(
        case.image, {"spacing": list(case.spacing)}, save_or_return_probabilities=True
    )
    expected = reference(SYNTHCT, case.name, False)
    np.testing.assert_array_equal(segmentation, expected.segmentation)
    assert probabilities.dtype == expected.probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities, expected.probabilities, atol=PROBABILITY_TOLERANCE)


def test_predict_from_files_writes_nnunet_layout_and_segmentations(server, tmp_path):
    source = model_dir(SYNTHCT).parent / "imagesTs"
    predictor = _predictor(server, use_mirroring=False)
    returned = predictor.predict_from_files(str(source), str(tmp_path), save_probabilities=True)

    names = [c.name for c in cases(SYNTHCT)]
    assert returned == [None] * len(names)
    expected_files = {"dataset.json", "plans.json", "predict_from_raw_data_args.json"}
    expected_files |= {f"{n}{e}" for n in names for e in (".nii.gz", ".npz", ".pkl")}
    assert {p.name for p in tmp_path.iterdir()} == expected_files
    assert json.loads((tmp_path / "dataset.json").read_text()) == json.loads(
        (model_dir(SYNTHCT) / "dataset.json").read_text()
    )
    for name in names:
        written = sitk.ReadImage(str(tmp_path / f"{name}.nii.gz"))
        image = sitk.ReadImage(str(source / f"{name}_0000.nii.gz"))
        np.testing.assert_array_equal(
            sitk.GetArrayFromImage(written), reference(SYNTHCT, name, False).segmentation
        )
        assert (written.GetSpacing(), written.GetOrigin(), written.GetDirection()) == (
            image.GetSpacing(),
            image.GetOrigin(),
            image.GetDirection(),
        )

    assert predictor.predict_from_files(str(source), str(tmp_path), overwrite=False) is None  # all done


def test_predict_from_list_of_npy_arrays_returns_one_result_per_image(server):
    predictor = _predictor(server, use_mirroring=False)
    chosen = cases(SYNTHCT)[:2]
    results = predictor.predict_from_list_of_npy_arrays(
        [c.image for c in chosen], None, [{"spacing": list(c.spacing)} for c in chosen], None
    )
    assert len(results) == 2
    for result, case in zip(results, chosen, strict=True):
        np.testing.assert_array_equal(result, reference(SYNTHCT, case.name, False).segmentation)


def test_predictor_refuses_what_the_endpoint_does_not_serve(server):
    with pytest.raises(UnsupportedModelError, match="always uses Gaussian"):
        TritonPredictor(use_gaussian=False, url=server.http_url)
    predictor = _predictor(server)
    case = cases(SYNTHCT)[0]
    with pytest.raises(UnsupportedModelError, match="cascades"):
        predictor.predict_single_npy_array(case.image, {"spacing": list(case.spacing)}, case.label)
    with pytest.raises(UnsupportedModelError, match="preprocessing runs on the server"):
        predictor.predict_from_data_iterator(iter([]))
