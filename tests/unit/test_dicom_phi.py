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


# pydicom's character set test files: (file, its SpecificCharacterSet), the name as pydicom decodes it
CHARSET_FILES = [("chrFren.dcm", "ISO_IR 100 (Latin-1)"), ("chrX1.dcm", "ISO_IR 192 (UTF-8)"),
                 ("chrJapMulti.dcm", "ISO 2022 IR 87"), ("chrH31.dcm", "ISO 2022 IR 13/87"),
                 ("chrKoreanMulti.dcm", "ISO 2022 IR 149"), ("chrX2.dcm", "GB18030"),
                 ("chrRuss.dcm", "ISO_IR 144"), ("chrGreek.dcm", "ISO_IR 126")]


@pytest.mark.parametrize(("name", "charset"), CHARSET_FILES, ids=[c for _, c in CHARSET_FILES])
def test_redaction_decodes_names_with_the_datasets_specific_character_set(name, charset):
    from pydicom.data import get_charset_files

    path = get_charset_files(name)[0]
    header = pydicom.dcmread(path, stop_before_pixels=True)  # as the node reads it: values still raw
    shown = str(pydicom.dcmread(path, stop_before_pixels=True).PatientName)  # what a message may print
    text = f"no axial slices in series {shown} of {shown.split('^')[0]}"

    redacted = describe(InputValidationError(text), [header])

    parts = {p for p in shown.replace("=", "^").split("^") if p.strip()}
    assert not [p for p in parts if p.strip() in redacted], (charset, redacted)
    assert redacted.startswith("InputValidationError: no axial slices in series <withheld>")
