"""Typed endpoints in the generated configs, and the clients keeping an image's own dtype."""

from __future__ import annotations

import numpy as np
import pytest
import SimpleITK as sitk
from test_model_specs import _config

from nnunet_triton import io_names
from nnunet_triton.builder.composite_specs import ensemble_repository_specs
from nnunet_triton.builder.model_specs import BuildOptions, repository_specs
from nnunet_triton.client import imageio
from nnunet_triton.client.client import _as_image


def _by_name(specs):
    return {spec.name: spec for spec in specs}


def test_every_image_dtype_has_an_endpoint_mapping_image_onto_its_preprocess_input():
    specs = _by_name(repository_specs(_config(), BuildOptions()))
    for dtype in io_names.IMAGE_DTYPES:
        endpoint = specs[io_names.typed_endpoint(dtype)]
        image = next(t for t in endpoint.inputs if t.name == io_names.IMAGE)
        assert image.dtype == dtype
        preprocess = endpoint.ensemble_steps[0]
        assert preprocess.input_map[io_names.image_input(dtype)] == io_names.IMAGE
        assert [s.model_name for s in endpoint.ensemble_steps] == [
            s.model_name for s in specs[io_names.ENDPOINT_MODEL].ensemble_steps]
    inputs = {t.name: t for t in specs[io_names.PREPROCESS_MODEL].inputs}
    assert all(inputs[io_names.image_input(d)].optional for d in io_names.IMAGE_DTYPES)
    assert not inputs[io_names.SPACING].optional


def test_configuration_ensembles_map_every_members_image_in_the_typed_endpoint():
    specs = _by_name(ensemble_repository_specs([_config(), _config()], BuildOptions()))
    endpoint = specs["nnunet_uint8"]
    image_steps = [s for s in endpoint.ensemble_steps if io_names.IMAGE in s.input_map.values()]
    assert len(image_steps) == 2
    assert all(set(s.input_map) >= {"IMAGE_UINT8"} and io_names.IMAGE not in s.input_map for s in image_steps)


def test_unknown_image_dtypes_are_refused_naming_the_choices():
    choices = r"\('FP32', 'FP16', 'INT16', 'UINT16', 'UINT8'\), got 'INT32'"
    for name in (io_names.typed_endpoint, io_names.image_input):
        with pytest.raises(ValueError, match=f"IMAGE dtype must be one of {choices}"):
            name("INT32")


@pytest.mark.parametrize(("dtype", "kept"), [(np.int16, True), (np.uint8, True), (np.float16, True),
                                             (np.float64, False), (np.int32, False), (">i2", True)])
def test_client_keeps_wire_dtypes_and_casts_the_rest_to_float32(dtype, kept):
    image = np.arange(24).reshape(2, 3, 4).astype(dtype)
    sent = _as_image(image, 3)
    assert sent.shape == (1, 2, 3, 4) and sent.flags.c_contiguous
    assert sent.dtype == (np.dtype(dtype).newbyteorder("=") if kept else np.float32)
    np.testing.assert_array_equal(sent[0].astype(np.float64), image.astype(np.float64))
    assert _as_image(image, 3, native=False).dtype == np.float32


def test_reading_a_case_keeps_the_files_dtype_only_when_asked_and_shared(tmp_path):
    a = sitk.GetImageFromArray(np.arange(60, dtype=np.int16).reshape(3, 4, 5))
    b = sitk.GetImageFromArray(np.ones((3, 4, 5), np.float32))
    sitk.WriteImage(a, str(tmp_path / "c_0000.nii.gz"))
    sitk.WriteImage(b, str(tmp_path / "c_0001.nii.gz"))
    one = [tmp_path / "c_0000.nii.gz"]
    assert imageio.read_images(one).data.dtype == np.float32  # nnU-Net's reader
    assert imageio.read_images(one, native_dtype=True).data.dtype == np.int16
    both = [tmp_path / "c_0000.nii.gz", tmp_path / "c_0001.nii.gz"]
    assert imageio.read_images(both, native_dtype=True).data.dtype == np.float32  # channels differ


def test_perf_input_data_in_int16_and_refused_when_values_do_not_fit():
    from tools.perf.input_data import input_data_document

    image = np.array([[[[-1.0, 2.0]]]], np.float32)
    document = input_data_document(image, np.ones(3), encoding="content", dtype="INT16")
    assert document["data"][0][io_names.IMAGE]["content"] == [-1, 2]
    with pytest.raises(ValueError, match="do not fit UINT8"):
        input_data_document(image, np.ones(3), dtype="UINT8")
