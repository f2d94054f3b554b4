"""The Triton CVEs of NVIDIA's security bulletins and what this product does about each: ``cves.json``.

One data file, one entry (one line) per CVE, read by three places so that they cannot disagree:

- the embedded launcher's startup warning (:func:`startup_warnings`, called by ``server.embedded``): beyond
  loopback it names the CVEs the TLS proxy does not fully mitigate, highest CVSS first; on loopback the ones
  another local user of the host can still exploit against tritonserver's own ports;
- docs/security.md's CVE section (rendered and written by ``python -m tools.security_table``; a unit test
  keeps the page equal to the rendering);
- ``tests/unit/test_cves.py``, which checks every entry (:func:`problems`) and that each test it names exists.

Fields of an entry: ``id``; ``bulletins`` (NVIDIA's ids, first is where it was published); ``published``;
``component``; ``cvss`` (base score, or null with the reason in ``cvss_source``); ``vector``; ``cwe``;
``cvss_source`` (where the score was read); ``summary``; ``affected`` (the bulletin's range);
``fixed_in`` (``ngc`` release ``YY.MM`` and ``triton`` version); ``embedded_2_51_exposed`` (the embedded
tritonserver 2.51.0 = NGC 24.10 is in the affected range and carries the component); ``mitigation``:
``status`` beyond loopback (through the TLS proxy), ``local`` on loopback against other local users (each
one of :data:`STATUSES`), ``how``, and ``tests`` (``tests/...py::test_name``). Adding the next bulletin is
adding its entries, one line each.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.builder.torch_compat import GPU_TRITON_RELEASE

__all__ = [
    "ABSENT_COMPONENTS",
    "DATA",
    "EMBEDDED_NGC",
    "STATUSES",
    "UNMITIGATED",
    "Cve",
    "Mitigation",
    "by_severity",
    "load",
    "open_in",
    "older_release_warning",
    "problems",
    "release_key",
    "startup_warnings",
    "unmitigated",
]

DATA = Path(__file__).with_name("cves.json")
EMBEDDED_NGC = "24.10"  # tritonserver 2.51.0 of the nvidia-pytriton 0.7.0 wheel
STATUSES = ("mitigated", "reduced", "exposed", "not-applicable")
UNMITIGATED = ("reduced", "exposed")  # what the startup warning names
# components some bulletins name that none of our servers carries (the wheel has the Python backend only, the
# gpu image is NGC's -pyt-python-py3 flavour; tests/unit/test_cves.py checks both)
ABSENT_COMPONENTS = ("DALI backend", "TensorRT backend", "MLflow plugin")
CVE_ID = re.compile(r"CVE-\d{4}-\d{4,7}")
RELEASE = re.compile(r"(\d{2})\.(\d{2})")
VERSION = re.compile(r"\d+\.\d+\.\d+")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
BULLETIN = re.compile(r"\d{4}")
TEST_REF = re.compile(r"tests/[\w/]+\.py::test_\w+")
REQUIRED = ("id", "bulletins", "published", "component", "cvss", "vector", "cwe", "cvss_source", "summary",
            "affected", "fixed_in", "embedded_2_51_exposed", "mitigation")


@dataclass(frozen=True)
class Mitigation:
    status: str  # beyond loopback, through the TLS proxy
    local: str  # on loopback, against another local user of the host
    how: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Cve:
    id: str
    bulletins: tuple[str, ...]
    published: str
    component: str
    cvss: float | None
    vector: str | None
    cwe: str | None
    cvss_source: str
    summary: str
    affected: str
    fixed_ngc: str
    fixed_triton: str
    embedded_2_51_exposed: bool
    mitigation: Mitigation

    @property
    def score(self) -> str:
        return "unknown" if self.cvss is None else f"{self.cvss:.1f}"


def release_key(release: str) -> tuple[int, int]:
    """``"26.07"`` -> ``(26, 7)``; ValueError naming the value otherwise."""
    match = RELEASE.fullmatch(release)
    if not match or not 1 <= int(match.group(2)) <= 12:
        raise ValueError(f"an NGC release is YY.MM (e.g. 26.07), got {release!r}.")
    return int(match.group(1)), int(match.group(2))


def _fixed_problems(fixed: Any) -> list[str]:
    if not isinstance(fixed, dict) or set(fixed) != {"ngc", "triton"}:
        return [f"fixed_in must be {{'ngc': 'YY.MM', 'triton': 'X.Y.Z'}}, got {fixed!r}"]
    found = []
    try:
        release_key(str(fixed["ngc"]))
    except ValueError as exc:
        found.append(f"fixed_in.ngc: {exc}")
    if not VERSION.fullmatch(str(fixed["triton"])):
        found.append(f"fixed_in.triton must be X.Y.Z, got {fixed['triton']!r}")
    return found


def _mitigation_problems(mitigation: Any, exposed: Any) -> list[str]:
    if not isinstance(mitigation, dict) or set(mitigation) != {"status", "local", "how", "tests"}:
        return [f"mitigation must have exactly status, local, how and tests, got {mitigation!r}"]
    found = [f"mitigation.{name} must be one of {STATUSES}, got {mitigation[name]!r}"
             for name in ("status", "local") if mitigation[name] not in STATUSES]
    tests = mitigation["tests"]
    checks = [
        (isinstance(mitigation["how"], str) and bool(mitigation["how"].strip()),
         "mitigation.how must say what is done (or why nothing is)"),
        (isinstance(tests, list) and all(isinstance(t, str) and TEST_REF.fullmatch(t) for t in tests),
         f"mitigation.tests must be a list of 'tests/<path>.py::test_<name>', got {tests!r}"),
        (mitigation["status"] not in ("mitigated", "reduced") or bool(tests),
         f"a {mitigation['status']!r} mitigation must name the test that shows it"),
        (exposed is not False or "not-applicable" in (mitigation["status"], mitigation["local"]),
         "not exposed in 2.51 but its mitigation is not 'not-applicable'"),
        (exposed is not True or mitigation["status"] != "not-applicable",
         "exposed in 2.51 but its mitigation says 'not-applicable'"),
    ]
    return found + [message for ok, message in checks if not ok]


def _entry_problems(index: int, entry: Any) -> list[str]:
    where = f"entry {index} ({entry.get('id', '?') if isinstance(entry, dict) else '?'})"
    if not isinstance(entry, dict):
        return [f"{where}: must be an object, got {entry!r}"]
    missing = [f"{where}: field {name!r} is missing" for name in REQUIRED if name not in entry]
    if missing:
        return missing
    checks: list[tuple[bool, str]] = [
        (isinstance(entry["id"], str) and bool(CVE_ID.fullmatch(entry["id"])),
         f"id must look like CVE-YYYY-NNNN, got {entry['id']!r}"),
        (isinstance(entry["bulletins"], list) and bool(entry["bulletins"])
         and all(isinstance(b, str) and BULLETIN.fullmatch(b) for b in entry["bulletins"]),
         f"bulletins must be a non-empty list of NVIDIA bulletin ids (4 digits), got {entry['bulletins']!r}"),
        (isinstance(entry["published"], str) and bool(DATE.fullmatch(entry["published"])),
         f"published must be YYYY-MM-DD, got {entry['published']!r}"),
        (entry["cvss"] is None or (isinstance(entry["cvss"], (int, float)) and 0 <= entry["cvss"] <= 10),
         f"cvss must be in [0, 10] or null, got {entry['cvss']!r}"),
        (entry["cvss"] is not None or "unknown" in str(entry["cvss_source"]).lower(),
         "a null cvss needs cvss_source to say why it is unknown"),
        (isinstance(entry["cvss_source"], str) and bool(entry["cvss_source"].strip()),
         "cvss_source must say where the score was read"),
        (isinstance(entry["embedded_2_51_exposed"], bool),
         f"embedded_2_51_exposed must be true or false, got {entry['embedded_2_51_exposed']!r}"),
        *((isinstance(entry[name], str) and bool(entry[name].strip()),
           f"{name} must be a non-empty text, got {entry[name]!r}")
          for name in ("component", "summary", "affected")),
    ]
    found = [message for ok, message in checks if not ok]
    found += _fixed_problems(entry["fixed_in"])
    found += _mitigation_problems(entry["mitigation"], entry["embedded_2_51_exposed"])
    return [f"{where}: {message}" for message in found]


def problems(data: Any) -> list[str]:
    """Every rule an entry of the table breaks (empty when the table is sound): fields, formats, statuses,
    duplicates, and that each Triton version belongs to one NGC release, later releases to later versions."""
    entries = data.get("cves") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        return ["the table must be an object with a non-empty 'cves' list"]
    found = [p for index, entry in enumerate(entries) for p in _entry_problems(index, entry)]
    if found:
        return found
    ids = [e["id"] for e in entries]
    found += [f"{cve} is listed {ids.count(cve)} times" for cve in sorted(set(ids)) if ids.count(cve) > 1]
    versions: dict[str, set[str]] = {}
    for entry in entries:
        versions.setdefault(entry["fixed_in"]["ngc"], set()).add(entry["fixed_in"]["triton"])
    found += [f"NGC {ngc} is given several Triton versions: {sorted(v)}" for ngc, v in versions.items()
              if len(v) > 1]
    ordered = sorted(versions, key=release_key)
    triton = {ngc: tuple(map(int, min(versions[ngc]).split("."))) for ngc in ordered}
    found += [f"NGC {a} ({versions[a]}) and {b} ({versions[b]}): a later release must have a later Triton"
              for a, b in zip(ordered, ordered[1:], strict=False) if triton[b] <= triton[a]]
    return found


def _parse(entry: dict[str, Any]) -> Cve:
    m = entry["mitigation"]
    return Cve(
        id=entry["id"], bulletins=tuple(entry["bulletins"]), published=entry["published"],
        component=entry["component"], cvss=None if entry["cvss"] is None else float(entry["cvss"]),
        vector=entry["vector"], cwe=entry["cwe"], cvss_source=entry["cvss_source"], summary=entry["summary"],
        affected=entry["affected"], fixed_ngc=entry["fixed_in"]["ngc"],
        fixed_triton=entry["fixed_in"]["triton"],
        embedded_2_51_exposed=entry["embedded_2_51_exposed"],
        mitigation=Mitigation(m["status"], m["local"], m["how"], tuple(m["tests"])),
    )


def load(path: str | Path = DATA) -> tuple[Cve, ...]:
    """The table at ``path`` (default: the packaged ``cves.json``); ValueError listing every problem."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    found = problems(data)
    if found:
        raise ValueError(f"{path}: the CVE table breaks {len(found)} rule(s): " + "; ".join(found))
    return tuple(_parse(entry) for entry in data["cves"])


def by_severity(cves: Iterable[Cve]) -> list[Cve]:
    """Highest CVSS first (unknown scores last), then by id."""
    return sorted(cves, key=lambda c: (c.cvss is None, -(c.cvss or 0.0), c.id))


def unmitigated(cves: Iterable[Cve], *, local: bool) -> list[Cve]:
    """The CVEs of the embedded 2.51 not fully mitigated beyond loopback (``local=False``: through the TLS
    proxy) or on loopback against other local users (``local=True``), highest CVSS first."""
    return by_severity(c for c in cves if c.embedded_2_51_exposed
                       and (c.mitigation.local if local else c.mitigation.status) in UNMITIGATED)


def open_in(release: str, cves: Iterable[Cve] | None = None) -> list[Cve]:
    """The CVEs our server on NGC ``release`` still has, by severity: fixed in a later release, ``release``
    inside the bulletin's range (a one-release range, like CVE-2024-53880's 24.11, counts only there), and in
    a component our servers carry (not :data:`ABSENT_COMPONENTS`)."""
    key = release_key(release)
    return by_severity(c for c in (load() if cves is None else cves)
                       if release_key(c.fixed_ngc) > key and c.component not in ABSENT_COMPONENTS
                       and (not RELEASE.fullmatch(c.affected) or release_key(c.affected) == key))


def older_release_warning(release: str, cves: Sequence[Cve] | None = None,
                          patched_release: str = GPU_TRITON_RELEASE) -> str | None:
    """The warning for a gpu image built on ``release`` when it lacks fixes the default base has (None when
    it has them all): no silent step back to a release with published CVEs."""
    open_ = open_in(release, cves)
    if not open_:
        return None
    return (f"NGC {release} lacks the fixes of {len(open_)} published Triton CVEs (by CVSS, "
            f"{_named(open_)}); the default base NGC {patched_release} has every fix of the table in "
            "docs/security.md")


def _named(cves: Sequence[Cve]) -> str:
    """``9.8: CVE-a, CVE-b; 7.5: CVE-c`` (``cves`` by severity)."""
    groups: dict[str, list[str]] = {}
    for c in cves:
        groups.setdefault(c.score, []).append(c.id)
    return "; ".join(f"{score}: {', '.join(ids)}" for score, ids in groups.items())


def startup_warnings(host: str, *, loopback: bool, cves: Sequence[Cve] | None = None,
                     patched_release: str | None = GPU_TRITON_RELEASE) -> list[str]:
    """What the embedded launcher warns about when it binds ``host``: the CVEs still open there, by severity.

    Beyond loopback: those the TLS proxy only reduces or leaves open; on loopback: those another local user
    can exploit against tritonserver's own ports. ``patched_release`` is the NGC release that fixes them all
    (the GPU image's), named as the way out."""
    cves = load() if cves is None else cves
    way_out = ("" if patched_release is None
               else f"; the gpu image (NGC {patched_release}) has every fix")
    open_ = unmitigated(cves, local=loopback)
    if not open_:
        return []
    if loopback:
        return [f"the embedded tritonserver 2.51.0 (NGC {EMBEDDED_NGC}) listens on {host} only, but any "
                f"local user of this host can reach it and exploit {len(open_)} published CVEs there (by "
                f"CVSS, {_named(open_)}){way_out}; see docs/security.md"]
    return [f"the embedded tritonserver 2.51.0 (NGC {EMBEDDED_NGC}) has {len(open_)} published CVEs that its "
            f"TLS proxy does not fully mitigate (by CVSS, {_named(open_)}); it now serves {host} through the "
            f"TLS proxy and gRPC SSL only{way_out}; see docs/security.md for what each mitigation covers"]
