"""The DICOM node's output kind (``--output`` / the routes' per-model ``"output"``): a DICOM-SEG, an RTSTRUCT
or both, sent together, a retry sending the very same objects without inference. Real pynetdicom peers on
loopback (:mod:`node_support`); the "model" is a threshold."""

from __future__ import annotations

import json

import pydicom
import pytest

from nnunet_triton.client.dicom.node import NodeModel
from nnunet_triton.client.dicom.outputs import DicomOutput
from nnunet_triton.client.dicom.routing import Routes
from nnunet_triton.errors import InputValidationError

try:
    from . import dicom_support as support
    from . import node_support as peers
except ImportError:
    import dicom_support as support
    import node_support as peers

SEG, RTSTRUCT = "1.2.840.10008.5.1.4.1.1.66.4", "1.2.840.10008.5.1.4.1.1.481.3"


@pytest.fixture
def dest():
    destination = peers.Destination().start()
    yield destination
    destination.stop()


def _kept(received, folder):
    """Save what the destination stored under the test's tmp_path (dciodvfy checks it at teardown)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, ds in enumerate(received):
        ds.save_as(folder / f"{k}.dcm", enforce_file_format=True)


@pytest.mark.parametrize("output", [DicomOutput.BOTH, DicomOutput.RTSTRUCT])
def test_node_sends_the_objects_its_route_asks_for_and_a_retry_sends_the_same_without_inference(
        tmp_path, dest, output):
    series = support.write_ct_series(tmp_path / "ct", n_slices=3, valid_ds=True)
    model = peers.Threshold(level=200.0)
    dest.status = 0xA700  # the PACS is out of resources for a while: the first send fails
    node = peers.running(peers.node_config(tmp_path / "spool", dest, None,
                                           models={"nnunet": NodeModel(model, output=output)}))
    try:
        peers.send(node.config.port, series.files)
        outgoing = tmp_path / "spool" / "outgoing"
        rt_file = outgoing / f"{series.series_uid}.rtstruct"
        peers.wait_for(rt_file.exists, what="the RTSTRUCT written")
        written = pydicom.dcmread(rt_file).SOPInstanceUID
        dest.status = 0x0000
        expected = 2 if output is DicomOutput.BOTH else 1
        received = dest.wait(expected)
        peers.wait_for(lambda: any(o == "sent" for _, o in node.processed), what="sent")
    finally:
        node.stop()

    assert sorted(str(ds.SOPClassUID) for ds in received) == sorted(
        [RTSTRUCT] + ([SEG] if output is DicomOutput.BOTH else []))
    rt = next(ds for ds in received if ds.SOPClassUID == RTSTRUCT)
    assert rt.SOPInstanceUID == written and model.calls == [series.series_uid]  # the same file, one inference
    series_ref = rt.ReferencedFrameOfReferenceSequence[0].RTReferencedStudySequence[0]
    assert series_ref.RTReferencedSeriesSequence[0].SeriesInstanceUID == series.series_uid
    assert [r.ROIName for r in rt.StructureSetROISequence] == ["label_1"]
    assert not rt_file.exists() and not (outgoing / f"{series.series_uid}.dcm").exists()
    record = json.loads((tmp_path / "spool" / "done" / f"{series.series_uid}.json").read_text())
    assert record["rt_sop_uid"] == written  # a late instance's round keeps the RTSTRUCT series
    _kept(received, tmp_path / "received")


def test_routes_take_an_output_per_model_and_refuse_an_unknown_one():
    routes = Routes.from_json(json.dumps({"default": "liver", "models": {"liver": {"output": "both"}}}))
    assert routes.settings_of("liver").output is DicomOutput.BOTH
    assert routes.settings_of("other").output is None  # the node's --output
    with pytest.raises(InputValidationError, match=r"models\['liver'\]\.output: one of \['seg', 'rtstruct', "
                                                   r"'both'\], got 'contours'"):
        Routes.from_json(json.dumps({"default": "liver", "models": {"liver": {"output": "contours"}}}))


def test_a_node_serving_an_endpoint_with_segment_metadata_sends_a_coded_coloured_seg_and_rtstruct(tmp_path,
                                                                                                   dest):
    """The labels the node takes from the endpoint's description (``model_segment_labels``, as ``listen``
    does) carry the metadata the endpoint publishes: the SEG and the RTSTRUCT it sends over DICOM are coded
    in SNOMED CT and coloured, and pass dciodvfy (checked at teardown)."""
    from pathlib import Path

    from nnunet_triton import segment_metadata as sm
    from nnunet_triton.client.dicom.seg import model_segment_labels
    from nnunet_triton.client.endpoint import EndpointDescription

    metadata = sm.read_segment_metadata(Path(__file__).resolve().parents[1] / "fixtures" / "seg_metadata"
                                        / "organ_lesion.json")
    published = {"labels": {"background": 0, "organ": 1, "lesion": 2},
                 sm.PUBLISHED_KEY: metadata.to_published()}
    description = EndpointDescription(url="x", model_name="nnunet", server_version="2.51.0", num_channels=1,
                                      num_heads=3, segmentation_dtype="UINT8", composing_models=(),
                                      fold_models=(), published=published)
    series = support.write_ct_series(tmp_path / "ct", n_slices=3, valid_ds=True)
    model = peers.Threshold(level=200.0)  # label 1 ("Organ") only; "Lesion" stays empty
    node = peers.running(peers.node_config(tmp_path / "spool", dest, None, models={"nnunet": NodeModel(
        model, labels=model_segment_labels(description), output=DicomOutput.BOTH)}))
    try:
        peers.send(node.config.port, series.files)
        received = dest.wait(2)
    finally:
        node.stop()
    seg = next(ds for ds in received if ds.SOPClassUID == SEG)
    rt = next(ds for ds in received if ds.SOPClassUID == RTSTRUCT)
    organ = seg.SegmentSequence[0]
    assert organ.SegmentLabel == "Organ"
    assert (organ.SegmentedPropertyTypeCodeSequence[0].CodingSchemeDesignator,
            organ.SegmentedPropertyTypeCodeSequence[0].CodeValue) == ("SCT", "91772007")
    assert list(organ.RecommendedDisplayCIELabValue) == list(metadata.coding(1).cielab)
    assert [r.ROIName for r in rt.StructureSetROISequence] == ["Organ", "Lesion"]
    codes = [o.RTROIIdentificationCodeSequence[0] for o in rt.RTROIObservationsSequence]
    assert [(c.CodingSchemeDesignator, c.CodeValue) for c in codes] == [("SCT", "91772007"),
                                                                         ("SCT", "52988006")]
    colours = {c.ReferencedROINumber: list(c.ROIDisplayColor) for c in rt.ROIContourSequence}
    assert colours[1] == list(metadata.coding(1).rgb)
    assert "ContourSequence" in rt.ROIContourSequence[0] and "ContourSequence" not in rt.ROIContourSequence[1]
    _kept(received, tmp_path / "received")
