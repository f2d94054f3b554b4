"""Endpoint description (published JSON, ``info`` text), retries on UNAVAILABLE only, CLI input discovery."""

from __future__ import annotations

import json

import pytest

from nnunet_triton import parameters
from nnunet_triton.client import endpoint
from nnunet_triton.client.endpoint import EndpointDescription
from nnunet_triton.errors import ClientError, ServerUnavailableError

try:
    from . import parity_support
except ImportError:
    import parity_support


class FlakyClient:
    """``segment`` fails with the given statuses first, then answers ``"ok"``."""

    def __init__(self, statuses):
        self.statuses, self.calls = list(statuses), []

    def segment(self, image, spacing, options=None, **overrides):
        self.calls.append(overrides)
        if self.statuses:
            raise ClientError("busy", status=self.statuses.pop(0))
        return "ok"


def test_segment_with_retry_backs_off_exponentially_when_server_is_unavailable():
    client, delays = FlakyClient(["StatusCode.UNAVAILABLE", "503"]), []
    result = endpoint.segment_with_retry(
        client, None, None, retries=3, backoff_s=0.5, sleep=delays.append, mirroring=False
    )
    assert (result, delays, client.calls) == ("ok", [0.5, 1.0], [{"mirroring": False}] * 3)


@pytest.mark.parametrize("statuses", [["400"], [None], ["StatusCode.INVALID_ARGUMENT"]])
def test_segment_with_retry_raises_at_once_when_error_is_not_unavailable(statuses):
    client, delays = FlakyClient(statuses), []
    with pytest.raises(ClientError, match="busy"):
        endpoint.segment_with_retry(client, None, None, sleep=delays.append)
    assert delays == [] and len(client.calls) == 1


class DeadModelClient:
    """``segment`` first fails with one of Triton's own errors about a model that is not running."""

    def __init__(self, status, message):
        kind = ClientError if status is not None else ServerUnavailableError  # the client's readiness check
        self.error, self.calls = kind(message, status=status), 0

    def segment(self, image, spacing, options=None, **overrides):
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return "ok"


@pytest.mark.parametrize(
    ("status", "message"),
    [
        ("500", "in ensemble 'nnunet', Stub process 'preprocess_model_0_0' is not healthy."),
        ("StatusCode.INTERNAL", "in ensemble 'nnunet', model 'fold_0' failed: Model 'fold_0' is not ready."),
        ("404", "Request for unknown model: 'nnunet' has no available versions"),
        (None, "model 'nnunet' is not ready on http://127.0.0.1:8000 (not in the repository, still loading, "
               "or failed to load: see the server log)."),
    ],
)
def test_segment_with_retry_retries_when_a_composing_model_is_not_running(status, message):
    client, delays = DeadModelClient(status, message), []
    assert endpoint.segment_with_retry(client, None, None, backoff_s=0.5, sleep=delays.append) == "ok"
    assert (delays, client.calls) == ([0.5], 2)


def test_segment_with_retry_raises_when_retries_are_exhausted():
    client, delays = FlakyClient(["503"] * 3), []
    with pytest.raises(ClientError, match="busy"):
        endpoint.segment_with_retry(client, None, None, retries=2, backoff_s=1.0, sleep=delays.append)
    assert delays == [1.0, 2.0]


@pytest.mark.parametrize("regions", [False, True], ids=["labels", "regions"])
def test_description_parameters_publish_dataset_labels_channels_and_axis_order(regions):
    dataset = parity_support.make_dataset_json(regions=regions)
    config = parity_support.inference_config(parity_support.make_plans(), dataset, "3d_fullres", folds=(0, 1))
    published = json.loads(parameters.description_parameters(config)[parameters.DESCRIPTION_PARAMETER])

    assert published["labels"] == dataset["labels"]
    assert published["regions_class_order"] == dataset.get("regions_class_order")
    assert published["channel_names"] == dataset["channel_names"]
    assert (published["file_ending"], published["axis_order"], published["folds"]) == (
        ".nii.gz",
        "zyx",
        [0, 1],
    )
    assert (published["dataset_name"], published["configuration"]) == ("Dataset999_Parity", "3d_fullres")


def _description(published=None) -> EndpointDescription:
    return EndpointDescription(
        url="http://h:8000",
        model_name="nnunet",
        server_version="2.51.0",
        num_channels=2,
        num_heads=3,
        segmentation_dtype="UINT8",
        composing_models=("preprocess_model", "orchestrator_model", "stitch_model"),
        fold_models=("fold_0",),
        published=published or {},
    )


def test_endpoint_description_uses_generic_labels_when_nothing_is_published():
    description = _description()
    assert description.labels == {"background": 0, "label_1": 1, "label_2": 2}
    assert description.file_ending == ".nii.gz"
    text = endpoint.format_description(description)
    assert "fold models     fold_0" in text and "(generic)" in text and "does not publish" in text


def test_endpoint_description_uses_published_labels():
    description = _description({"labels": {"background": 0, "liver": 1, "tumor": 2}, "file_ending": ".nrrd"})
    assert description.labels == {"background": 0, "liver": 1, "tumor": 2}
    assert description.file_ending == ".nrrd"
    assert 'file_ending     ".nrrd"' in endpoint.format_description(description)
