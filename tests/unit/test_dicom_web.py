"""DICOMweb as an attacker or a careless PACS would serve it: untrusted UIDs never become paths, only the
series that fit are downloaded, plain http stays on loopback, secrets never come from the command line.

The PACS is a real HTTP server on loopback (``http.server``) that answers QIDO-RS, WADO-RS metadata and
WADO-RS multipart/related retrievals with the bytes a malicious or broken server could send; it records
every request, so a test sees what the client asked for. (Orthanc itself refuses such UIDs, which is why
it cannot play this part; the Orthanc tests in ``tests/triton/test_cli_pacs.py`` cover the normal way.)
"""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pydicom
import pytest

from nnunet_triton import cli
from nnunet_triton.client.dicom.modality import ModalityRule, expected_modalities
from nnunet_triton.client.dicom.uids import UnsafeIdentifierError
from nnunet_triton.client.dicom.web import DicomWebAuth, DicomWebLocation, fetch_study
from nnunet_triton.errors import PacsError

try:
    from . import dicom_support as support
except ImportError:  # run from tests/unit without package context
    import dicom_support as support

STUDY = "1.2.826.0.1.3680043.8.498.77"
BOUNDARY = "nnunet-boundary"


class FakePacs:
    """``series``: {series UID (as the server states it): (Modality, [instance bytes])}."""

    def __init__(self, series: dict[str, tuple[str, list[bytes]]]) -> None:
        self.series = series
        self.requests: list[str] = []
        pacs = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):  # noqa: N802 - the http.server name
                pacs.requests.append(self.path.split("?")[0])
                status, body, kind = pacs.answer(self.path.split("?")[0])
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"dicomweb://127.0.0.1:{self.httpd.server_address[1]}/dicom-web"

    def answer(self, path: str) -> tuple[int, bytes, str]:
        parts = path.removeprefix("/dicom-web/").split("/")
        if len(parts) == 3 and parts[2] == "series":  # QIDO-RS: the study's series
            items = [{"0020000E": {"vr": "UI", "Value": [uid]}, "00080060": {"vr": "CS", "Value": [modality]},
                      "00201209": {"vr": "IS", "Value": [len(instances)]}}
                     for uid, (modality, instances) in self.series.items()]
            return 200, json.dumps(items).encode(), "application/dicom+json"
        uid = parts[3] if len(parts) >= 4 else ""
        if uid not in self.series:
            return 404, b"", "text/plain"
        instances = self.series[uid][1]
        if len(parts) == 5 and parts[4] == "metadata":
            metadata = []
            for data in instances:
                ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
                metadata.append(ds.to_json_dict())
            return 200, json.dumps(metadata).encode(), "application/dicom+json"
        body = b"".join(f"--{BOUNDARY}\r\nContent-Type: application/dicom\r\n\r\n".encode() + data + b"\r\n"
                        for data in instances) + f"--{BOUNDARY}--\r\n".encode()
        return 200, body, f'multipart/related; type="application/dicom"; boundary={BOUNDARY}'

    def retrieved(self) -> set[str]:
        """The series whose instances (pixel data) were downloaded."""
        return {p.split("/")[5] for p in self.requests if p.count("/") == 5}

    def close(self) -> None:
        self.httpd.shutdown()


def _bytes(path: Path, **changes: str) -> bytes:
    ds = pydicom.dcmread(path)
    for keyword, value in changes.items():
        setattr(ds, keyword, value)
        if keyword == "SOPInstanceUID":
            ds.file_meta.MediaStorageSOPInstanceUID = value
    buffer = io.BytesIO()
    ds.save_as(buffer, enforce_file_format=True)
    return buffer.getvalue()


@pytest.fixture
def ct(tmp_path):
    series = support.write_ct_series(tmp_path / "ct", n_slices=3)
    for path in series.files:  # one study for every series of these tests
        ds = pydicom.dcmread(path)
        ds.StudyInstanceUID = STUDY
        ds.save_as(path, enforce_file_format=True)
    return series


def test_fetch_study_refuses_instances_whose_sop_uid_would_leave_the_folder_keeping_the_others(ct, tmp_path):
    good = [_bytes(p) for p in ct.files[:2]]
    absolute = tmp_path / "abs" / "x"  # an absolute path, as a PACS could send it
    evil = [_bytes(ct.files[2], SOPInstanceUID="../../../x"),
            _bytes(ct.files[2], SOPInstanceUID=str(absolute)),
            _bytes(ct.files[2], SeriesInstanceUID="1.2.3")]  # an instance of another series
    pacs = FakePacs({ct.series_uid: ("CT", good + evil)})
    work = tmp_path / "deep" / "er" / "study"
    try:
        fetched = fetch_study(DicomWebLocation.parse(pacs.url), STUDY, work)
    finally:
        pacs.close()

    assert fetched == [ct.series_uid]
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.dcm")
                     if "ct" not in p.parts)
    assert written == sorted(f"deep/er/study/{ct.series_uid}/{u}.dcm" for u in ct.sop_uids[:2])
    assert not (tmp_path / "abs").exists()


def test_fetch_study_downloads_only_the_image_series_that_fit_the_model(ct, tmp_path):
    mr = support.write_ct_series(tmp_path / "mr", n_slices=2, modality="MR", seed=3)
    scout = support.write_localizer(tmp_path / "scout", "1.2.826.0.1.3680043.8.498.91")
    report = support.write_non_images(tmp_path / "sr")[0]
    pacs = FakePacs({
        ct.series_uid: ("CT", [_bytes(p) for p in ct.files]),
        mr.series_uid: ("MR", [_bytes(p) for p in mr.files]),
        "1.2.826.0.1.3680043.8.498.91": ("CT", [_bytes(scout)]),  # a localizer-only series
        str(pydicom.dcmread(report).SeriesInstanceUID): ("SR", [_bytes(report)]),
        "../../etc": ("CT", [_bytes(ct.files[0])]),
    })
    try:
        fetched = fetch_study(DicomWebLocation.parse(pacs.url), STUDY, tmp_path / "work",
                              rule=ModalityRule(expected_modalities({"0": "CT"})))
    finally:
        pacs.close()

    assert fetched == [ct.series_uid]
    assert pacs.retrieved() == {ct.series_uid}  # nothing else was downloaded, not even to be skipped
    assert sorted(p.name for p in (tmp_path / "work" / ct.series_uid).iterdir()) == sorted(
        f"{u}.dcm" for u in ct.sop_uids)


def test_fetch_study_names_each_series_reason_when_none_is_eligible(ct, tmp_path):
    mr = support.write_ct_series(tmp_path / "mr", n_slices=2, modality="MR", seed=3)
    pacs = FakePacs({mr.series_uid: ("MR", [_bytes(p) for p in mr.files])})
    try:
        with pytest.raises(PacsError, match=rf"study {STUDY}: no eligible image series \(1 series: "
                                            rf"{mr.series_uid}: Modality MR does not fit the model"):
            fetch_study(DicomWebLocation.parse(pacs.url), STUDY, tmp_path / "work",
                        rule=ModalityRule(frozenset({"CT"})))
    finally:
        pacs.close()
    assert pacs.retrieved() == set()


@pytest.mark.parametrize(("study", "series"), [("../x", None), (STUDY, "1.2/../../3")])
def test_fetch_study_refuses_a_study_or_series_argument_that_is_no_uid_before_any_request(study, series,
                                                                                          tmp_path):
    pacs = FakePacs({})
    try:
        with pytest.raises(UnsafeIdentifierError, match=r"--(study|series) \(\w+InstanceUID\) must be a "):
            fetch_study(DicomWebLocation.parse(pacs.url), study, tmp_path / "work", series_uid=series)
    finally:
        pacs.close()
    assert pacs.requests == []


def test_dicomweb_location_refuses_plain_http_beyond_loopback_unless_allowed_explicitly():
    with pytest.raises(PacsError, match=r"plain http \(dicomweb://\) to a host other than loopback"):
        DicomWebLocation.parse("dicomweb://pacs.hospital.org:8042/dicom-web")
    with pytest.raises(PacsError, match="plain http"):
        DicomWebLocation.parse("dicomweb://10.1.2.3/dicom-web")
    assert DicomWebLocation.parse("dicomweb://127.0.0.1:8042/r").url == "http://127.0.0.1:8042/r"
    assert DicomWebLocation.parse("dicomweb://[::1]:8042/r").url == "http://[::1]:8042/r"
    assert DicomWebLocation.parse("dicomwebs://pacs.hospital.org/r").url == "https://pacs.hospital.org/r"
    assert DicomWebLocation.parse("dicomweb://pacs/r", allow_http=True).url == "http://pacs/r"


def test_predict_refuses_plain_http_to_a_remote_pacs_before_contacting_anything(tmp_path, capsys):
    code = cli.main(["predict", "-i", "dicomweb://pacs.hospital.org/dicom-web", "--study", STUDY,
                     "-o", str(tmp_path / "out"), "--url", "127.0.0.1:1"])
    assert code == 2
    assert "plain http (dicomweb://) to a host other than loopback" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--dicomweb-password", "--dicomweb-token"])
def test_predict_refuses_a_secret_on_the_command_line_without_echoing_it(flag, tmp_path, capsys):
    code = cli.main(["predict", "-i", "dicomweb://127.0.0.1:1/dicom-web", "--study", STUDY, "-o",
                     str(tmp_path / "out"), flag, "hunter2-secret", "--url", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{flag} on the command line is visible to every user" in err and f"{flag}-file" in err
    assert "hunter2" not in err


def test_dicomweb_auth_reads_secrets_from_files_or_the_environment(tmp_path, monkeypatch):
    (tmp_path / "password").write_text("s3cr3t\n")
    (tmp_path / "two-lines").write_text("a\nb\n")
    monkeypatch.delenv("NNUNET_TRITON_DICOMWEB_TOKEN", raising=False)
    assert DicomWebAuth.from_env(user="ai", password_file=tmp_path / "password").password == "s3cr3t"
    monkeypatch.setenv("NNUNET_TRITON_DICOMWEB_TOKEN", "env-token")
    assert DicomWebAuth.from_env().token == "env-token"
    with pytest.raises(PacsError, match=r"the password file '.*two-lines' must hold one non-empty line"):
        DicomWebAuth.from_env(user="ai", password_file=tmp_path / "two-lines")
    with pytest.raises(PacsError, match=r"cannot read the token file '.*missing'"):
        DicomWebAuth.from_env(token_file=tmp_path / "missing")


class Redirector:
    """An HTTP server on ``host`` that answers every GET with a 302 to ``target`` + the path (or records it
    when ``target`` is None)."""

    def __init__(self, host: str, target: str | None) -> None:
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):  # noqa: N802 - the http.server name
                owner.requests.append(self.path)
                self.send_response(302 if target else 404)
                if target:
                    self.send_header("Location", target + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.mark.parametrize("where", ["another host", "another port"])
def test_dicomweb_client_does_not_follow_a_redirect_to_another_origin(where, tmp_path):
    elsewhere = Redirector("127.0.0.2" if where == "another host" else "127.0.0.1", None)
    pacs = Redirector("127.0.0.1", f"http://{elsewhere.httpd.server_address[0]}:{elsewhere.port}")
    try:
        with pytest.raises(PacsError, match=r"HTTP 302 redirect to another origin \(http://127\.0\.0\.[12]:"
                                            r"\d+\) is not followed"):
            location = DicomWebLocation.parse(f"dicomweb://127.0.0.1:{pacs.port}/dicom-web")
            fetch_study(location, STUDY, tmp_path)
    finally:
        pacs.close()
        elsewhere.close()
    assert pacs.requests and not elsewhere.requests
