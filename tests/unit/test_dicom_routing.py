"""Which model a series received by the DICOM node goes to (:mod:`nnunet_triton.client.dicom.routing`), the
routes file as an administrator writes it (and gets it wrong), and ``nnunet-triton listen`` checking every
routed model on the server at start.

The routes run on plain mappings and on real pydicom headers; ``listen`` talks HTTP (tritonclient) to a
small stand-in for Triton's model metadata and config API that serves some models and not others.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pydicom
import pytest

from nnunet_triton.client.dicom.routing import (
    MAX_VALUE_CHARS,
    NoRoute,
    Route,
    Routes,
    Rule,
)
from nnunet_triton.errors import InputValidationError

try:
    from . import dicom_support as support
except ImportError:  # run from tests/unit without package context
    import dicom_support as support

EXAMPLE = {
    "default": "nnunet",
    "called_ae_titles": {"NNUNET_LIVER": "liver", "NNUNET_LUNG": "lung"},
    "rules": [
        {"match": {"Modality": "CT", "BodyPartExamined": "LIVER|ABDOMEN",
                   "SeriesDescription": "(?i).*portal.*"},
         "model": "liver", "comment": "portal venous CT"},
        {"match": {"Modality": "MR"}, "model": "prostate"},
        {"match": {"Modality": "CT", "BodyPartExamined": "CHEST"}, "model": "lung"},
    ],
}


def _routes(**changes) -> Routes:
    return Routes.from_json(json.dumps({**EXAMPLE, **changes}))


PORTAL = {"Modality": "CT", "BodyPartExamined": "ABDOMEN", "SeriesDescription": "Abd PORTAL venous 1.5mm"}


# --- deciding ---------------------------------------------------------------------------------------------
def test_the_called_ae_title_wins_over_the_rules_and_the_default():
    routes = _routes()
    assert routes.decide("NNUNET_LUNG", PORTAL) == Route("lung", "called AE title NNUNET_LUNG")
    assert routes.decide("NNUNET_LUNG  ", PORTAL).model == "lung"  # DICOM pads AE titles with spaces


def test_rules_are_tried_in_file_order_and_the_first_that_matches_every_key_wins():
    routes = _routes()
    assert routes.decide("NNUNET", PORTAL) == Route("liver", "rule 0 (Modality, BodyPartExamined, "
                                                             "SeriesDescription)")
    arterial = {**PORTAL, "SeriesDescription": "Abd arterial"}  # one key of rule 0 fails: not rule 0
    assert routes.decide("NNUNET", arterial) == Route("nnunet", "default")
    chest = {"Modality": "CT", "BodyPartExamined": "CHEST", "SeriesDescription": "portal"}
    assert routes.route("NNUNET", chest) == "lung"
    both = _routes(rules=[{"match": {"Modality": "CT"}, "model": "lung"}, *EXAMPLE["rules"]])
    assert both.route("NNUNET", PORTAL) == "lung"


def test_a_rule_matches_the_whole_value_never_a_part_of_it():
    routes = _routes()
    for body_part in ("ABDOMENPELVIS", "XLIVER", "LIVER "):  # (trailing padding is stripped first)
        decided = routes.decide(None, {**PORTAL, "BodyPartExamined": body_part})
        assert decided.model == ("liver" if body_part == "LIVER " else "nnunet"), body_part


def test_an_absent_empty_or_overlong_attribute_never_matches_even_a_pattern_for_anything():
    routes = _routes(rules=[{"match": {"BodyPartExamined": ".*"}, "model": "liver"}])
    assert routes.route(None, {"BodyPartExamined": "x"}) == "liver"
    assert routes.route(None, {}) == "nnunet"
    assert routes.route(None, {"BodyPartExamined": ""}) == "nnunet"
    assert routes.route(None, {"BodyPartExamined": None}) == "nnunet"
    assert routes.route(None, {"BodyPartExamined": "A" * MAX_VALUE_CHARS}) == "liver"
    assert routes.route(None, {"BodyPartExamined": "A" * (MAX_VALUE_CHARS + 1)}) == "nnunet"
    assert routes.route(None, {"BodyPartExamined": b"LIVER"}) == "nnunet"  # undecoded bytes


def test_rules_read_real_dicom_headers_with_multiple_values_as_dicom_writes_them():
    ds = support.template()
    ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
    ds.BodyPartExamined = "LIVER"
    ds.SeriesDescription = "PORTAL VENOUS"
    routes = _routes(rules=[{"match": {"ImageType": r"ORIGINAL\\PRIMARY\\.*"}, "model": "lung"},
                            *EXAMPLE["rules"]])
    assert routes.decide("NNUNET", ds) == Route("lung", "rule 0 (ImageType)")
    ds.ImageType = ["DERIVED", "SECONDARY"]
    assert routes.decide("NNUNET", ds) == Route("liver", "rule 1 (Modality, BodyPartExamined, "
                                                         "SeriesDescription)")
    del ds.BodyPartExamined
    assert routes.decide("NNUNET", ds) == Route("nnunet", "default")


def test_without_a_default_a_series_nothing_routes_has_no_route_and_the_reason_holds_no_patient_data():
    routes = _routes(default=None)
    header = {**PORTAL, "SeriesDescription": "Doe^Jane arterial", "BodyPartExamined": "HEAD"}
    with pytest.raises(NoRoute) as raised:
        routes.decide("NNUNET", header)
    message = str(raised.value)
    assert message == ("no route: the called AE title NNUNET is not one of called_ae_titles, none of the 3 "
                       "rule(s) matches (Modality CT) and routes has no default model")
    assert isinstance(raised.value, InputValidationError)
    with pytest.raises(NoRoute) as unknown:
        routes.decide(None, {"Modality": "Doe^Jane"})
    assert "the called AE title is not known" in str(unknown.value) and "Doe" not in str(unknown.value)


def test_the_default_routes_send_everything_to_nnunet():
    routes = Routes()
    assert routes.route(None, {}) == "nnunet" and routes.route("ANY", PORTAL) == "nnunet"
    assert routes.models == ("nnunet",) and routes.keywords == ()


def test_routes_list_each_model_once_and_the_attributes_their_rules_read():
    routes = _routes()
    assert routes.models == ("nnunet", "liver", "lung", "prostate")
    assert routes.keywords == ("Modality", "BodyPartExamined", "SeriesDescription")
    assert routes.where("lung") == "called_ae_titles['NNUNET_LUNG'], rules[2] of routes"


# --- reading the file -----------------------------------------------------------------------------------
def _error(text: str, **kwargs) -> str:
    with pytest.raises(InputValidationError) as raised:
        Routes.from_json(text, **kwargs)
    return str(raised.value)


def _bad(**changes) -> str:
    return _error(json.dumps({**EXAMPLE, **changes}))


def test_an_invalid_regular_expression_is_refused_naming_the_rule_the_key_and_the_expression():
    broken = {"match": {"SeriesDescription": "(?i)portal(("}, "model": "liver"}
    message = _bad(rules=[EXAMPLE["rules"][0], broken])
    assert message.startswith("routes: rules[1].match.SeriesDescription: invalid regular expression "
                              "'(?i)portal((': missing ), unterminated subpattern")


def test_the_file_is_json_only_with_its_known_keys_and_no_duplicates():
    assert "not valid JSON" in _error("{'default': 'nnunet'}")  # a Python literal
    assert "not valid JSON" in _error("cos\nsystem\n(S'id'\ntR.")  # a pickle
    assert "not valid JSON: NaN is not JSON" in _error('{"default": "nnunet", "x": NaN}')
    assert "duplicate key 'NNUNET_LIVER'" in _error(
        '{"called_ae_titles": {"NNUNET_LIVER": "liver", "NNUNET_LIVER": "lung"}}')
    assert "top level: a JSON object, got list" in _error("[]")
    assert "top level: unknown key(s) ['route']" in _bad(route={})
    assert "rules[0]: unknown key(s) ['models']" in _bad(rules=[{"match": {"Modality": "CT"}, "models": "x"}])
    assert 'rules[0]: needs "match" and "model"' in _bad(rules=[{"match": {"Modality": "CT"}}])
    assert "rules[0].match: an object of DICOM keyword" in _bad(rules=[{"match": {}, "model": "liver"}])
    assert "rules: a list of at most 1000 rules" in _bad(rules={"match": {}})


def test_rules_may_read_acquisition_attributes_only_never_the_patients():
    message = _bad(rules=[{"match": {"PatientName": "Doe.*"}, "model": "liver"}])
    assert message.startswith("routes: rules[0].match: 'PatientName' is not an attribute rules may read "
                              "(Modality, BodyPartExamined, SeriesDescription")


@pytest.mark.parametrize("title", ["NNUNET_LIVER_TOO_LONG", "", "A\\B", " LIVER", "LIVER ", "LEBER\u00dc",
                                   "TAB\tAE"])
def test_called_ae_titles_must_be_valid_ae_titles(title):
    message = _bad(called_ae_titles={title: "liver"})
    assert "an AE title must have 1 to 16 printable ASCII characters" in message
    assert message.startswith(f"routes: called_ae_titles[{title!r}]")


@pytest.mark.parametrize("where, changes", [
    ("default", {"default": "Liver"}),
    ("called_ae_titles['NNUNET_LIVER']", {"called_ae_titles": {"NNUNET_LIVER": "liver_fp16"}}),
    ("rules[0].model", {"rules": [{"match": {"Modality": "CT"}, "model": "../liver"}]}),
    ("rules[0].model", {"rules": [{"match": {"Modality": "CT"}, "model": 7}]}),
])
def test_model_names_must_be_endpoint_names(where, changes):
    assert _bad(**changes).startswith(f"routes: {where}: endpoint name")


def test_the_default_comes_from_the_file_or_from_model_but_is_said_once():
    without = {k: v for k, v in EXAMPLE.items() if k != "default"}
    assert Routes.from_json(json.dumps(without)).default == "nnunet"
    assert Routes.from_json(json.dumps(without), model="lung").default == "lung"
    assert Routes.from_json(json.dumps(EXAMPLE), model="nnunet").default == "nnunet"
    assert "default: 'nnunet' differs from --endpoint 'lung'" in _error(json.dumps(EXAMPLE), model="lung")
    assert _routes(default=None).default is None  # a file without a default model is fine ...
    nothing = _error(json.dumps({"default": None}))  # ... unless it then routes nowhere
    assert nothing == "routes: default: no model to send series to (no default, no called AE title, no rule)"


def test_model_settings_pin_versions_modalities_and_labels_of_routed_models_only(tmp_path):
    models = {"liver": {"version": 2, "modality": ["ct"], "dataset_json": "liver/dataset.json"},
              "lung": {"modality": "CT", "dataset_json": "/abs/lung.json"}}
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({**EXAMPLE, "models": models}))
    routes = Routes.load(path)
    liver, lung = routes.settings_of("liver"), routes.settings_of("lung")
    assert (liver.version, liver.modality) == (2, ("CT",))
    assert liver.dataset_json == tmp_path / "liver" / "dataset.json"  # relative to the routes file
    assert (lung.version, lung.modality, lung.dataset_json) == (None, ("CT",), Path("/abs/lung.json"))
    assert routes.settings_of("nnunet").version is None
    assert "models['brain']: no route sends series to this model" in _bad(models={"brain": {}})
    for version in (0, True, "2"):
        assert "models['liver'].version: an integer >= 1" in _bad(models={"liver": {"version": version}})
    assert "models['liver'].modality: DICOM Modality values" in _bad(models={"liver": {"modality": ["C T"]}})
    assert "models['liver']: unknown key(s) ['labels']" in _bad(models={"liver": {"labels": {}}})


def test_loading_names_the_file_and_refuses_what_is_not_a_small_utf8_json_file(tmp_path):
    with pytest.raises(InputValidationError, match=r"routes file .*missing\.json: cannot be read"):
        Routes.load(tmp_path / "missing.json")
    big = tmp_path / "big.json"
    big.write_text(" " * (1 << 20) + "{}")
    with pytest.raises(InputValidationError, match="larger than 1048576 bytes"):
        Routes.load(big)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"comment": "\xe9"}')
    with pytest.raises(InputValidationError, match="not UTF-8 text"):
        Routes.load(latin)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**EXAMPLE, "rules": [{"match": {"Modality": "["}, "model": "liver"}]}))
    expected = rf"^routes file {bad}: rules\[0\]\.match\.Modality: invalid regular expression '\['"
    with pytest.raises(InputValidationError, match=expected):
        Routes.load(bad)


def test_rules_made_in_python_are_checked_like_those_of_a_file():
    with pytest.raises(InputValidationError, match=r"rules\[3\]\.match\.Modality: invalid regular "):
        Rule.of("liver", {"Modality": "(CT"}, index=3)
    with pytest.raises(InputValidationError, match="'PatientID' is not an attribute rules may read"):
        Rule.of("liver", {"PatientID": ".*"})
    with pytest.raises(InputValidationError, match="a rule must match at least one attribute"):
        Rule("liver", ())
    rule = Rule.of("liver", {"Modality": "CT|MR"})
    assert rule.matches(pydicom.Dataset()) is False and rule.matches({"Modality": "MR"})


# --- nnunet-triton listen: every routed model on the server ------------------------------------------------
def _published(channel: str, labels: dict[str, int]) -> dict:
    return {"channel_names": {"0": channel}, "labels": labels}


class FakeTriton:
    """Triton's HTTP metadata and config API (KServe v2) for the models in ``published``; any other model
    is answered as Triton answers an unknown one (400, 'Request for unknown model')."""

    def __init__(self, published: dict[str, dict]) -> None:
        self.published = published
        self.asked: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):  # noqa: N802 - http.server's name
                status, body = fake.answer(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def answer(self, path: str) -> tuple[int, dict]:
        parts = path.strip("/").split("/")
        if parts == ["v2"]:
            return 200, {"name": "triton", "version": "2.50.0", "extensions": []}
        if len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            name = parts[2]
            self.asked.append(name)
            if name not in self.published:
                return 400, {"error": f"Request for unknown model: '{name}' is not found"}
            if parts[3:] == ["config"]:
                return 200, {"name": name, "parameters": {
                    "nnunet_description": {"string_value": json.dumps(self.published[name])}}}
            return 200, {"name": name, "versions": ["1"], "platform": "ensemble",
                         "inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [1, -1, -1, -1]}],
                         "outputs": [{"name": "SEGMENTATION", "datatype": "UINT8", "shape": [-1, -1, -1]}]}
        return 404, {"error": "not found"}

    def __enter__(self) -> FakeTriton:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def _warnings_left_alone():
    """``listen`` routes Python warnings through logging for its process; give them back after a test."""
    import logging

    yield
    logging.captureWarnings(False)


def _listen_args(tmp_path, server, *extra):
    from nnunet_triton.cli import parser

    return parser().parse_args(["listen", "--url", server.url, "--spool", str(tmp_path / "spool"),
                                "--destination", "PACS@127.0.0.1:104", *extra])


def test_listen_stops_at_start_naming_a_routed_model_the_server_does_not_serve(tmp_path, capsys):
    from nnunet_triton.cli import main

    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps(EXAMPLE))
    served = {name: _published("CT", {"background": 0, "organ": 1}) for name in ("nnunet", "liver", "lung")}
    with FakeTriton(served) as server:  # no "prostate"
        code = main(["listen", "--url", server.url, "--spool", str(tmp_path / "spool"), "--destination",
                     "PACS@127.0.0.1:104", "--routes", str(routes)])

    err = capsys.readouterr().err
    assert code == 2
    assert f"model 'prostate' (rules[1] of routes file {routes}) cannot be used: cannot describe model " \
           "'prostate'" in err and "unknown model" in err
    assert not (tmp_path / "spool").exists()  # nothing was started


def test_listen_gives_each_routed_model_its_own_endpoint_modality_rule_and_labels(tmp_path):
    from nnunet_triton.cli.listen import _node_models, _routes

    labels = tmp_path / "liver" / "dataset.json"
    labels.parent.mkdir()
    labels.write_text(json.dumps({"labels": {"background": 0, "liver": 1, "tumour": 2}}))
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({**EXAMPLE, "models": {"liver": {"version": 2,
                                                                  "dataset_json": "liver/dataset.json"}}}))
    served = {"nnunet": _published("zscore", {"background": 0, "spleen": 1}),
              "liver__v2": _published("CT", {"background": 0, "x": 1}),
              "lung": _published("CT", {"background": 0, "lung": 1, "nodule": 2}),
              "prostate": _published("T2", {"background": 0, "prostate": 1})}
    with FakeTriton(served) as server:
        args = _listen_args(tmp_path, server, "--routes", str(routes), "--modality", "CT", "MR")
        models, clients = _node_models(args, server.url, _routes(args))
    try:
        assert list(models) == ["nnunet", "liver", "lung", "prostate"]
        rules = {name: sorted(m.modalities.allowed or ()) for name, m in models.items()}
        assert rules == {"nnunet": ["CT", "MR"], "liver": ["CT"], "lung": ["CT"], "prostate": ["MR"]}
        names = {name: [s.name for s in m.labels] for name, m in models.items()}
        assert names == {"nnunet": ["spleen"], "liver": ["liver", "tumour"], "lung": ["lung", "nodule"],
                         "prostate": ["prostate"]}
        # per model, the worker's client and the monitor's readiness probe
        assert [c.model_name for c in clients] == [m for m in ("nnunet", "liver__v2", "lung", "prostate")
                                                   for _ in range(2)]
        assert server.asked.count("liver") == 0  # the pinned version was described, not the promoted one
    finally:
        for client in clients:
            client.close()


def test_listen_without_routes_sends_everything_to_model(tmp_path):
    from nnunet_triton.cli.listen import _node_models, _routes

    with FakeTriton({"spleen": _published("CT", {"background": 0, "spleen": 1})}) as server:
        args = _listen_args(tmp_path, server, "--endpoint", "spleen")
        routes = _routes(args)
        models, clients = _node_models(args, server.url, routes)
    for client in clients:
        client.close()
    assert routes.route("ANY", PORTAL) == "spleen" and list(models) == ["spleen"]
    assert [c.model_name for c in clients] == ["spleen", "spleen"]  # the worker's client and the probe


def test_listen_refuses_a_bad_model_name_and_default_model_settings_without_a_default(tmp_path, capsys):
    from nnunet_triton.cli import main

    with pytest.raises(SystemExit):
        main(["listen", "--spool", str(tmp_path), "--destination", "P@h:1", "--endpoint", "Liver"])
    assert "endpoint name must be lowercase letters" in capsys.readouterr().err
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({**EXAMPLE, "default": None}))
    code = main(["listen", "--spool", str(tmp_path / "spool"), "--destination", "P@h:1", "--routes",
                 str(routes), "--dataset-json", str(tmp_path / "d.json")])
    assert code == 2
    assert f"--modality and --dataset-json are the default model's, and routes file {routes} has none" in (
        capsys.readouterr().err)


def test_listen_keeps_its_spool_private_from_other_local_users(tmp_path):
    """The node's spool (patients' images, names in logs) is 0700 whatever the caller's umask: another local
    user cannot list or read it."""
    import os
    import signal
    import socket
    import stat
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spool = tmp_path / "spool"
    served = {"nnunet": _published("CT", {"background": 0, "organ": 1})}
    with FakeTriton(served) as server:
        node = subprocess.Popen(
            [sys.executable, "-m", "nnunet_triton.cli", "listen", "--url", server.url, "--spool", str(spool),
             "--port", str(port), "--destination", "PACS@127.0.0.1:104"],
            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.umask(0o022))
        try:
            lines = []
            for line in node.stderr:  # until the node says it listens (or exits)
                lines.append(line)
                if "listening as" in line:
                    break
            assert any("listening as" in line for line in lines), "".join(lines)
            modes = {path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.stat().st_mode)
                     for path in (spool, *spool.rglob("*"))}
            assert modes and all(mode & 0o077 == 0 for mode in modes.values()), modes
        finally:
            node.send_signal(signal.SIGTERM)
            node.communicate(timeout=60)
    assert node.returncode == 0
