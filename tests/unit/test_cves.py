"""The Triton CVE table (``server/cves.json``): sound entries, every bulletin through 2026-09, tests that
exist, docs/security.md equal to its rendering, a gpu base with every fix, the startup warning by severity."""

from __future__ import annotations

import copy
import inspect
import json
import logging
import re
import sys
from pathlib import Path

import pytest

from nnunet_triton.builder.torch_compat import GPU_TRITON_RELEASE
from nnunet_triton.server import cves, embedded
from nnunet_triton.server.deploy import docker
from tools import security_table

ROOT = Path(__file__).resolve().parents[2]
# NVIDIA's Triton Inference Server bulletins published 2025-01 .. 2026-09 (NVIDIA/product-security; 5875 from
# third-party summaries): the table must cover each; a later bulletin may be added without touching this set
BULLETINS_THROUGH_2026_09 = {"5612", "5687", "5691", "5723", "5734", "5790", "5816", "5828", "5848", "5853",
                             "5860", "5865", "5875"}
LAST_OF_THEM = "2026-09-08"


@pytest.fixture(scope="module")
def data() -> dict:
    return json.loads(cves.DATA.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def table() -> tuple[cves.Cve, ...]:
    return cves.load()


def test_every_entry_of_the_cve_table_keeps_the_rules(data: dict, table: tuple[cves.Cve, ...]) -> None:
    assert cves.problems(data) == []
    assert len(table) == len(data["cves"]) >= 59


@pytest.mark.parametrize(("change", "problem"), [
    (lambda e: e.update(id="CVE-25-1"), "id must look like CVE-YYYY-NNNN, got 'CVE-25-1'"),
    (lambda e: e.update(cvss=10.5), "cvss must be in [0, 10] or null, got 10.5"),
    (lambda e: e.update(cvss=None), "a null cvss needs cvss_source to say why it is unknown"),
    (lambda e: e["fixed_in"].update(ngc="26.13"), "an NGC release is YY.MM (e.g. 26.07), got '26.13'"),
    (lambda e: e["fixed_in"].update(triton="2.71"), "fixed_in.triton must be X.Y.Z, got '2.71'"),
    (lambda e: e.update(bulletins=["NV-5687"]), "bulletins must be a non-empty list of NVIDIA bulletin ids"),
    (lambda e: e["mitigation"].update(status="fixed"), "mitigation.status must be one of"),
    (lambda e: e["mitigation"].update(tests=[]), "a 'mitigated' mitigation must name the test that shows it"),
    (lambda e: e["mitigation"].update(tests=["test_tls_proxy.py::chunked"]),
     "mitigation.tests must be a list of 'tests/<path>.py::test_<name>'"),
    (lambda e: e.pop("component"), "field 'component' is missing"),
    (lambda e: e.update(embedded_2_51_exposed=False), "not exposed in 2.51 but its mitigation is not"),
])
def test_the_table_rules_refuse_a_broken_entry_naming_it(data: dict, change, problem: str) -> None:
    broken = copy.deepcopy(data)
    index = next(i for i, e in enumerate(broken["cves"]) if e["id"] == "CVE-2025-23310")  # a mitigated 9.8
    change(broken["cves"][index])
    found = cves.problems(broken)
    assert any(problem in p and p.startswith(f"entry {index} (") for p in found), found


def test_the_table_rules_refuse_a_duplicate_and_a_release_with_two_triton_versions(data: dict) -> None:
    broken = copy.deepcopy(data)
    broken["cves"].append(copy.deepcopy(broken["cves"][-1]))
    broken["cves"][-1]["fixed_in"]["triton"] = "2.99.0"
    found = cves.problems(broken)
    assert f"{broken['cves'][-1]['id']} is listed 2 times" in found
    assert any("is given several Triton versions" in p for p in found), found


def test_every_test_a_mitigation_names_exists_in_the_test_tree(table: tuple[cves.Cve, ...]) -> None:
    missing = []
    for ref in sorted({t for c in table for t in c.mitigation.tests}):
        path, name = ref.split("::")
        source = ROOT / path
        defined = source.is_file() and re.search(rf"^(async )?def {name}\(", source.read_text(), re.MULTILINE)
        if not defined:
            missing.append(ref)
    assert missing == [], f"the CVE table names tests that do not exist: {missing}"


def test_the_table_covers_every_triton_bulletin_from_2025_01_to_2026_09(table: tuple[cves.Cve, ...]) -> None:
    named = {b for c in table for b in c.bulletins}
    assert BULLETINS_THROUGH_2026_09 <= named
    later = {c.published for c in table if set(c.bulletins) - BULLETINS_THROUGH_2026_09}
    assert all(date > LAST_OF_THEM for date in later), later  # only newer bulletins may be added
    assert {c.published for c in table if "5875" in c.bulletins} == {LAST_OF_THEM}


def test_the_cves_the_issue_names_carry_their_published_scores_and_fixes(table: tuple[cves.Cve, ...]) -> None:
    found = {c.id: (c.cvss, c.fixed_ngc, c.bulletins[0]) for c in table}
    assert found["CVE-2025-23316"] == (9.8, "25.08", "5691")
    assert found["CVE-2025-23329"] == (7.5, "25.08", "5691")
    assert found["CVE-2025-33202"] == (7.5, "25.09", "5723")
    assert found["CVE-2025-33201"] == (7.5, "25.10", "5734")
    assert found["CVE-2026-24158"] == (7.5, "26.01", "5790")
    assert found["CVE-2026-24264"] == (7.5, "26.04", "5848")
    assert found["CVE-2026-24207"] == (9.8, "26.03", "5828")
    assert found["CVE-2026-24206"] == (7.3, "26.03", "5828")
    assert found["CVE-2026-47481"] == (6.5, "26.05", "5853")
    assert found["CVE-2026-47625"] == (7.5, "26.04", "5875")
    assert found["CVE-2026-47627"] == (9.8, "26.06", "5865")
    assert found["CVE-2026-16497"] == (7.5, "26.07", "5875")
    third_party = {c.id for c in table if not c.cvss_source.startswith("NVIDIA bulletin")}
    assert third_party == {"CVE-2026-47625", "CVE-2026-16497"}


def test_every_entry_is_one_line_so_a_new_bulletin_is_a_one_line_change_per_cve(data: dict) -> None:
    lines = [line for line in cves.DATA.read_text(encoding="utf-8").splitlines() if '"id": "CVE-' in line]
    assert len(lines) == len(data["cves"])
    assert all(json.loads(line.strip().rstrip(",")) in data["cves"] for line in lines)


def test_the_gpu_images_base_has_every_fix_of_the_table(table: tuple[cves.Cve, ...]) -> None:
    newest = max((c.fixed_ngc for c in table), key=cves.release_key)
    assert cves.release_key(GPU_TRITON_RELEASE) >= cves.release_key(newest), (GPU_TRITON_RELEASE, newest)


def test_docs_security_md_shows_the_rendering_of_the_table() -> None:
    page = security_table.PAGE.read_text(encoding="utf-8")
    assert security_table.rendered(page) == page, "stale: run python -m tools.security_table"
    assert page.count("| CVE-") == len(cves.load())


def test_no_dali_tensorrt_or_mlflow_code_is_shipped_with_the_servers() -> None:
    """The not-applicable entries rest on this: the embedded wheel carries the Python backend only, the gpu
    image is NGC's -pyt-python-py3 flavour (PyTorch and Python backends only), no requirement pulls MLflow."""
    backends = next((Path(p) / "pytriton" / "tritonserver" / "backends" for p in sys.path
                     if (Path(p) / "pytriton" / "tritonserver" / "backends").is_dir()), None)
    if backends is not None:  # the wheel is installed (make setup)
        assert {d.name for d in backends.iterdir()} == {"python"}
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-pyt-python-py3" in dockerfile
    assert '-pyt-python-py3"' in inspect.getsource(docker.DeploySpec.base_image.fget)
    requirements = " ".join(p.read_text().lower() for p in (ROOT / "requirements").glob("*.txt"))
    assert not re.search(r"^(mlflow|nvidia-dali|tensorrt)", requirements, re.MULTILINE)


def test_warning_beyond_loopback_names_what_the_proxy_leaves_open_highest_cvss_first(
        table: tuple[cves.Cve, ...]) -> None:
    (message,) = cves.startup_warnings("0.0.0.0", loopback=False, cves=table)
    assert "it now serves 0.0.0.0 through the TLS proxy" in message
    assert "(by CVSS, 9.8: CVE-2026-24207, CVE-2026-47627; 9.1: CVE-2025-23317; 7.5: " in message
    for gone in ("CVE-2025-23310", "CVE-2025-23316", "CVE-2026-24158", "CVE-2025-23268", "CVE-2024-53880"):
        assert gone not in message  # mitigated through the proxy, or not in 2.51
    scores = [float(s) for s in re.findall(r"(\d+\.\d): CVE", message)]
    assert scores == sorted(scores, reverse=True)
    assert f"the gpu image (NGC {GPU_TRITON_RELEASE}) has every fix" in message


def test_warning_on_loopback_names_what_another_local_user_can_exploit(table: tuple[cves.Cve, ...]) -> None:
    (message,) = cves.startup_warnings("127.0.0.1", loopback=True, cves=table)
    assert message.startswith("the embedded tritonserver 2.51.0 (NGC 24.10) listens on 127.0.0.1 only, but "
                              "any local user of this host can reach it")
    assert "9.8: CVE-2025-23310, CVE-2025-23311, CVE-2026-24207, CVE-2026-47627;" in message
    assert "CVE-2026-24264" in message  # the decompression bomb on the loopback port
    for closed in ("CVE-2025-23316", "CVE-2025-23319", "CVE-2025-23329", "CVE-2025-33238"):
        assert closed not in message  # the token, the shm API, 0600 regions, the frontends


def test_a_table_with_everything_mitigated_gives_no_warning(table: tuple[cves.Cve, ...]) -> None:
    quiet = [c for c in table if c.mitigation.status not in cves.UNMITIGATED]
    assert cves.startup_warnings("0.0.0.0", loopback=False, cves=quiet) == []


def test_the_embedded_launcher_logs_the_warning_of_where_it_binds(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=embedded.LOGGER.name)
    for host in ("127.0.0.1", "0.0.0.0"):
        embedded._warn_known_cves(host)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2
    assert "listens on 127.0.0.1 only" in warnings[0]
    assert "CVEs that its TLS proxy does not fully mitigate" in warnings[1]


def test_an_older_release_names_the_cves_it_still_has_and_the_default_base_none(
        table: tuple[cves.Cve, ...]) -> None:
    assert cves.open_in(GPU_TRITON_RELEASE, table) == []
    old = [c.id for c in cves.open_in("25.12", table)]
    assert old[:2] == ["CVE-2026-24207", "CVE-2026-47627"]  # both 9.8s of 2026 first
    assert "CVE-2025-23310" not in old and "CVE-2026-47625" in old
    # the data agrees with itself: what 24.10 still has is what the table marks exposed in 2.51
    assert {c.id for c in cves.open_in(cves.EMBEDDED_NGC, table)} == {
        c.id for c in table if c.embedded_2_51_exposed}
    assert {c.component for c in table if not c.embedded_2_51_exposed} == {
        *cves.ABSENT_COMPONENTS, "model loading API"}  # CVE-2024-53880: its range is 24.11 alone


def test_deploying_the_gpu_image_on_an_older_release_warns_which_fixes_it_lacks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from deploy_support import REPO_ROOT

    from nnunet_triton.cli import deploy as tool
    from nnunet_triton.server.deploy import service

    fixture = REPO_ROOT / "tests" / "fixtures" / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny"
    monkeypatch.setattr(service, "local_torch_fits", lambda plan: False)
    caplog.set_level(logging.WARNING)
    for release in ("25.12", GPU_TRITON_RELEASE):
        assert tool.main(["--target", "docker", "--model-dir", str(fixture), "--out", str(tmp_path / release),
                          "--variant", "gpu", "--engine", "docker", "--triton-release", release,
                          "--dry-run"]) == 0
    warned = [r.getMessage() for r in caplog.records if "lacks the fixes" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("--triton-release 25.12: NGC 25.12 lacks the fixes of ")
    assert "9.8: CVE-2026-24207, CVE-2026-47627;" in warned[0]
