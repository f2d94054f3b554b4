"""Patient data never reaches a log line or an error file, whatever another library puts in its messages."""

from __future__ import annotations

import logging

import pydicom
import pytest

from nnunet_triton.client.dicom.phi import RedactingFilter, describe, phi_values, raw_text, redact
from nnunet_triton.errors import InputValidationError


def _patient() -> pydicom.Dataset:
    ds = pydicom.Dataset()
    ds.PatientName, ds.PatientID, ds.OtherPatientIDs = "Doe^Jane^Q", "MRN-4711", ["A-1", "B-22"]
    return ds


def test_describe_withholds_the_value_pydicom_puts_in_its_conversion_error():
    with pytest.raises(ValueError) as caught:
        pydicom.valuerep.DA("1975-03-01")  # a real pydicom error, as highdicom raised it for the SEG

    assert "1975-03-01" in str(caught.value)
    assert describe(caught.value) == "ValueError: Unable to convert '<withheld>' to 'DA' object"


def test_redact_removes_the_patient_values_of_the_datasets_and_keeps_uids_tags_and_keywords():
    text = ("patient Doe^Jane^Q (MRN-4711, A-1) 'Jane' in series '1.2.840.10008.5.1.4.1.1.2' at (0010, 0010) "
            "'PatientName' 'PN'")
    assert redact(text, [_patient()]) == (
        "patient <withheld> (<withheld>, <withheld>) '<withheld>' in series '1.2.840.10008.5.1.4.1.1.2' "
        "at (0010, 0010) 'PatientName' 'PN'")


def test_phi_values_read_values_as_stored_without_pydicom_converting_them(tmp_path, caplog):
    ds = pydicom.Dataset()
    ds.add_new("PatientBirthDate", "DA", "1975-03-01")  # stored as is; converting it would log it
    assert raw_text(ds, "PatientBirthDate") == "1975-03-01" and raw_text(ds, "PatientID") is None
    assert {"Doe^Jane^Q", "Doe", "Jane", "MRN-4711", "A-1", "B-22"} <= phi_values([_patient()])


def test_redacting_filter_masks_third_party_records_and_leaves_ours_alone():
    record = logging.LogRecord("highdicom.base", logging.WARNING, __file__, 1,
                               'value of argument "patient_name" is potentially invalid: "%s"', ("Doe^Jane",),
                               None)
    ours = logging.LogRecord("nnunet_triton.client.dicom.node", logging.INFO, __file__, 1, "series %s: sent",
                             ("1.2.3",), None)
    for item in (record, ours):
        RedactingFilter().filter(item)
    assert record.getMessage() == 'value of argument "<withheld>" is potentially invalid: "<withheld>"'
    assert ours.getMessage() == "series 1.2.3: sent"


def test_describe_keeps_our_own_messages_that_name_rules_and_uids():
    error = InputValidationError("series 1.2.3: gap (missing slices?) between IM0001.dcm and IM0003.dcm")
    assert describe(error) == f"InputValidationError: {error}"
