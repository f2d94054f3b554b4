"""Which model (endpoint) the DICOM node sends a received series to: by the called AE title, by rules on the
series' attributes, else the default.

The node's routes come from a JSON file (``nnunet-triton listen --routes FILE``)::

    {"default": "nnunet",
     "called_ae_titles": {"NNUNET_LIVER": "liver", "NNUNET_LUNG": "lung"},
     "rules": [{"match": {"Modality": "CT", "BodyPartExamined": "LIVER|ABDOMEN",
                          "SeriesDescription": "(?i).*portal.*"},
                "model": "liver", "comment": "portal venous CT"}],
     "models": {"liver": {"version": 2, "modality": ["CT"], "dataset_json": "liver/dataset.json",
                          "output": "both"}}}

:meth:`Routes.decide` picks, in this order:

1. **the called AE title** of the association that stored the series' first instance, when
   ``called_ae_titles`` maps it (the node accepts associations to these titles besides its own);
2. **the first rule that matches**, in file order: every key of ``match`` is a DICOM keyword of
   :data:`ROUTING_KEYWORDS` and its regular expression must match the attribute's whole value
   (``re.fullmatch``); an absent or empty attribute, or a value longer than :data:`MAX_VALUE_CHARS`, never
   matches. A multi-valued attribute is matched as DICOM writes it (``ORIGINAL\\PRIMARY``);
3. **the default** (``default``; ``nnunet`` when the file does not say, ``null`` for none): with no default
   a series nothing routes is set aside (:class:`NoRoute`).

``models`` (optional) holds per-model settings: ``version`` (call exactly that version, the pinned
endpoint), ``modality`` (the Modality values it takes, instead of those of its channel names),
``dataset_json`` (names its segments when the server does not publish them; relative to the file) and
``output`` (``seg``, ``rtstruct`` or ``both``: the DICOM objects its results become; default: the node's
``--output``).

The file is checked when it is read, and every error names the input, the place (the rule's index, the
key) and the value: JSON only (duplicate keys, ``NaN`` and unknown keys are refused), endpoint names by
:func:`~nnunet_triton.io_names.check_endpoint_name`, AE titles of 1 to 16 printable ASCII characters
without ``\\`` or surrounding spaces, regular expressions compiled at once. Every value a rule reads comes
from the network and is untrusted: it is only ever matched, never evaluated, and messages do not quote it
(a SeriesDescription may name a patient).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.client.dicom.outputs import DicomOutput
from nnunet_triton.errors import InputValidationError

__all__ = ["Routes", "Rule", "Route", "ModelSettings", "NoRoute", "ROUTING_KEYWORDS", "MAX_VALUE_CHARS",
           "attribute_text"]

# attributes a rule may read: what describes the acquisition, never the patient
ROUTING_KEYWORDS = ("Modality", "BodyPartExamined", "SeriesDescription", "StudyDescription", "ProtocolName",
                    "StationName", "Manufacturer", "ManufacturerModelName", "SOPClassUID", "ImageType")
MAX_VALUE_CHARS = 256  # DICOM CS/LO/SH values are <= 64 characters; longer ones never match
MAX_FILE_BYTES = 1 << 20
MAX_RULES = 1000
MAX_PATTERN_CHARS = 1024
_TOP_KEYS = ("default", "called_ae_titles", "rules", "models", "comment")
_RULE_KEYS = ("match", "model", "comment")
_MODEL_KEYS = ("version", "modality", "dataset_json", "output", "comment")
_MODALITY = re.compile(r"[A-Z]{2,16}")


class NoRoute(InputValidationError):
    """No called AE title mapping, no rule and no default routes a series."""


def _fail(source: str, where: str, message: str) -> InputValidationError:
    return InputValidationError(f"{source}: {where}: {message}")


def check_ae_title(title: object, *, source: str = "routes", where: str = "AE title") -> str:
    """``title`` when it is an AE title the node can answer to: 1 to 16 printable ASCII characters, no
    ``\\``, no leading or trailing spaces (DICOM ignores them, so two titles would look alike)."""
    if not isinstance(title, str) or not 1 <= len(title) <= 16 or not title.isascii() or (
            not title.isprintable()) or "\\" in title or title != title.strip():
        raise _fail(source, where, f"an AE title must have 1 to 16 printable ASCII characters, no '\\' and "
                                   f"no leading or trailing spaces, got {ascii(title)[:40]}")
    return title


def _endpoint(name: object, *, source: str, where: str) -> str:
    try:
        return io_names.check_endpoint_name(name)  # type: ignore[arg-type]
    except ValueError as exc:
        raise _fail(source, where, str(exc)) from None


def attribute_text(dataset: Any, keyword: str) -> str | None:
    """The value of ``keyword`` in ``dataset`` (a pydicom Dataset or a mapping) as the text a rule matches:
    multiple values joined by ``\\``, DICOM padding stripped; None when absent, empty, unreadable or longer
    than :data:`MAX_VALUE_CHARS`."""
    try:
        value = dataset.get(keyword)
    except Exception:  # noqa: BLE001 - a value pydicom cannot decode never matches
        return None
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return None  # an undecoded value: nothing an administrator's rule can mean
    if isinstance(value, Iterable) and not isinstance(value, str):
        text = "\\".join(str(v) for v in value)
    else:
        text = str(value)
    text = text.strip(" \x00")
    if not text or len(text) > MAX_VALUE_CHARS:
        return None
    return text


@dataclass(frozen=True)
class Rule:
    """Route to ``model`` a series whose attributes all fullmatch ``match``: (keyword, pattern) pairs."""

    model: str
    match: tuple[tuple[str, re.Pattern[str]], ...]
    index: int = 0

    def __post_init__(self) -> None:
        where = f"rules[{self.index}]"
        _endpoint(self.model, source="routes", where=f"{where}.model")
        if not self.match:
            raise _fail("routes", f"{where}.match", "a rule must match at least one attribute")
        for keyword, _ in self.match:
            if keyword not in ROUTING_KEYWORDS:
                raise _fail("routes", f"{where}.match", f"{keyword!r} is not an attribute rules may read "
                                                        f"({', '.join(ROUTING_KEYWORDS)})")

    @classmethod
    def of(cls, model: str, match: Mapping[str, str], *, index: int = 0, source: str = "routes") -> Rule:
        """A rule from keyword -> regular expression (compiled here; a bad one names the rule and key)."""
        compiled = []
        for keyword, pattern in match.items():
            where = f"rules[{index}].match.{keyword}"
            if not isinstance(pattern, str) or not 0 < len(pattern) <= MAX_PATTERN_CHARS:
                raise _fail(source, where, f"a regular expression of 1 to {MAX_PATTERN_CHARS} characters, "
                                           f"got {ascii(pattern)[:80]}")
            try:
                compiled.append((keyword, re.compile(pattern)))
            except re.error as exc:
                raise _fail(source, where, f"invalid regular expression {pattern!r}: {exc}") from None
        return cls(model, tuple(compiled), index)

    def matches(self, dataset: Any) -> bool:
        for keyword, pattern in self.match:
            text = attribute_text(dataset, keyword)
            if text is None or pattern.fullmatch(text) is None:
                return False
        return True

    def describe(self) -> str:
        return f"rule {self.index} ({', '.join(k for k, _ in self.match)})"


@dataclass(frozen=True)
class ModelSettings:
    """Per-model settings of the routes file: a pinned ``version``, the ``modality`` values it takes, the
    ``dataset_json`` naming its segments (None: from the server), the ``output`` objects (None: the node's
    ``--output``)."""

    version: int | None = None
    modality: tuple[str, ...] | None = None
    dataset_json: Path | None = None
    output: DicomOutput | None = None


@dataclass(frozen=True)
class Route:
    """Where a series goes (``model``) and why (``reason``: ``called AE title X``, ``rule 0 (...)``,
    ``default``)."""

    model: str
    reason: str


@dataclass(frozen=True)
class Routes:
    """The node's routes; see the module docstring. ``Routes()`` sends everything to ``nnunet``."""

    default: str | None = io_names.ENDPOINT_MODEL
    called_ae_titles: Mapping[str, str] = field(default_factory=dict)
    rules: tuple[Rule, ...] = ()
    settings: Mapping[str, ModelSettings] = field(default_factory=dict)
    source: str = "routes"

    def __post_init__(self) -> None:
        if self.default is not None:
            _endpoint(self.default, source=self.source, where="default")
        for title, model in self.called_ae_titles.items():
            check_ae_title(title, source=self.source, where=f"called_ae_titles[{title!r}]")
            _endpoint(model, source=self.source, where=f"called_ae_titles[{title!r}]")
        for name in self.settings:
            if name not in self.models:
                raise _fail(self.source, f"models[{name!r}]", "no route sends series to this model (name it "
                                                              "in default, called_ae_titles or a rule)")
        if not self.models:
            raise _fail(self.source, "default", "no model to send series to (no default, no called AE "
                                                "title, no rule)")
        object.__setattr__(self, "called_ae_titles", MappingProxyType(dict(self.called_ae_titles)))
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))

    # --- reading -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Path, *, model: str | None = None) -> Routes:
        """The routes of the JSON file ``path``; ``model``: see :meth:`from_json`."""
        path = Path(path)
        try:
            with path.open("rb") as handle:
                data = handle.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise InputValidationError(f"routes file {path}: cannot be read ({exc.strerror or exc})."
                                       ) from None
        if len(data) > MAX_FILE_BYTES:
            raise InputValidationError(f"routes file {path}: larger than {MAX_FILE_BYTES} bytes.")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InputValidationError(f"routes file {path}: not UTF-8 text.") from None
        return cls.from_json(text, source=f"routes file {path}", model=model, base=path.parent)

    @classmethod
    def from_json(cls, text: str, *, source: str = "routes", model: str | None = None,
                  base: Path | None = None) -> Routes:
        """The routes of a JSON document.

        Args:
            source: names the input in error messages (``routes file /etc/nnunet/routes.json``).
            model: the ``--endpoint`` flag: the default model when the document has no ``default``; None when
                the flag was not given (then ``nnunet``). Given as well as a different ``default`` in the
                document, it is an error (one default, said once).
            base: folder that relative ``dataset_json`` paths are relative to (default: as given).
        """
        if model is not None:
            _endpoint(model, source="--endpoint", where="the default model")
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        except ValueError as exc:
            raise InputValidationError(f"{source}: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise _fail(source, "top level", f"a JSON object, got {type(data).__name__}")
        _known(data, _TOP_KEYS, source, "top level")
        if "default" in data:
            default = data["default"]
            if default is not None:
                default = _endpoint(default, source=source, where="default")
            if model is not None and default != model:
                raise _fail(source, "default", f"{default!r} differs from --endpoint {model!r}: give the "
                                               "default model once")
        else:
            default = model or io_names.ENDPOINT_MODEL
        titles = data.get("called_ae_titles", {})
        if not isinstance(titles, dict):
            raise _fail(source, "called_ae_titles", "an object of AE title -> model name")
        for title, name in titles.items():
            where = f"called_ae_titles[{title!r}]"
            check_ae_title(title, source=source, where=where)
            _endpoint(name, source=source, where=where)
        rules_data = data.get("rules", [])
        if not isinstance(rules_data, list) or len(rules_data) > MAX_RULES:
            raise _fail(source, "rules", f"a list of at most {MAX_RULES} rules")
        rules = tuple(_rule(item, index, source) for index, item in enumerate(rules_data))
        settings_data = data.get("models", {})
        if not isinstance(settings_data, dict):
            raise _fail(source, "models", "an object of model name -> settings")
        settings = {_endpoint(name, source=source, where=f"models[{name!r}]"):
                    _settings(value, name, source, base) for name, value in settings_data.items()}
        if "comment" in data and not isinstance(data["comment"], str):
            raise _fail(source, "comment", "a string")
        return cls(default, titles, rules, settings, source)

    # --- deciding ----------------------------------------------------------------------------------
    @property
    def models(self) -> tuple[str, ...]:
        """Every model a series may be routed to, once each: the default, the AE titles', the rules'."""
        names = ([self.default] if self.default else []) + list(self.called_ae_titles.values()) + [
            r.model for r in self.rules]
        return tuple(dict.fromkeys(names))

    @property
    def keywords(self) -> tuple[str, ...]:
        """The attributes the rules read (what a header read for routing needs)."""
        return tuple(dict.fromkeys(k for rule in self.rules for k, _ in rule.match))

    def settings_of(self, model: str) -> ModelSettings:
        return self.settings.get(model, ModelSettings())

    def where(self, model: str) -> str:
        """Where the routes name ``model``, for messages: ``default``, ``called_ae_titles['X']``,
        ``rules[2]``."""
        places = (["default"] if model == self.default else []) + [
            f"called_ae_titles[{t!r}]" for t, m in self.called_ae_titles.items() if m == model] + [
            f"rules[{r.index}]" for r in self.rules if r.model == model]
        return f"{', '.join(places) or 'nowhere'} of {self.source}"

    def decide(self, called_ae: str | None, dataset: Any) -> Route:
        """The route of a series whose first instance came to ``called_ae`` (None: unknown) with the header
        ``dataset``; raises :class:`NoRoute` when nothing routes it."""
        called = called_ae.strip() if isinstance(called_ae, str) else None
        if called:
            model = self.called_ae_titles.get(called)
            if model is not None:
                return Route(model, f"called AE title {called}")
        for rule in self.rules:
            if rule.matches(dataset):
                return Route(rule.model, rule.describe())
        if self.default is not None:
            return Route(self.default, "default")
        modality = attribute_text(dataset, "Modality")
        shown_modality = modality if modality and _MODALITY.fullmatch(modality) else "(none or not a code)"
        # unquoted (error files mask quoted values), escaped and cut: it came from the network
        title = (f"the called AE title {ascii(called)[1:-1][:32]} is not one of called_ae_titles" if called
                 else "the called AE title is not known")
        raise NoRoute(f"no route: {title}, none of the {len(self.rules)} rule(s) matches (Modality "
                      f"{shown_modality}) and {self.source} has no default model")

    def route(self, called_ae: str | None, dataset: Any) -> str:
        """The endpoint name :meth:`decide` picks."""
        return self.decide(called_ae, dataset).model

    def summary(self) -> dict[str, Any]:
        """What ``status.json`` shows of the routes."""
        return {"default": self.default, "called_ae_titles": dict(self.called_ae_titles),
                "rules": len(self.rules), "models": list(self.models)}


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _known(data: Mapping[str, Any], allowed: tuple[str, ...], source: str, where: str) -> None:
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise _fail(source, where, f"unknown key(s) {unknown}; known: {list(allowed)}")


def _rule(item: object, index: int, source: str) -> Rule:
    where = f"rules[{index}]"
    if not isinstance(item, dict):
        raise _fail(source, where, 'an object {"match": {...}, "model": NAME}')
    _known(item, _RULE_KEYS, source, where)
    if "model" not in item or "match" not in item:
        raise _fail(source, where, 'needs "match" and "model"')
    if not isinstance(item["match"], dict) or not item["match"]:
        raise _fail(source, f"{where}.match",
                    "an object of DICOM keyword -> regular expression (at least one)")
    for keyword in item["match"]:
        if keyword not in ROUTING_KEYWORDS:
            raise _fail(source, f"{where}.match", f"{keyword!r} is not an attribute rules may read "
                                                  f"({', '.join(ROUTING_KEYWORDS)})")
    model = _endpoint(item["model"], source=source, where=f"{where}.model")
    if "comment" in item and not isinstance(item["comment"], str):
        raise _fail(source, f"{where}.comment", "a string")
    return Rule.of(model, item["match"], index=index, source=source)


def _settings(value: object, name: str, source: str, base: Path | None) -> ModelSettings:
    where = f"models[{name!r}]"
    if not isinstance(value, dict):
        raise _fail(source, where, 'an object {"version": N, "modality": [...], "dataset_json": PATH}')
    _known(value, _MODEL_KEYS, source, where)
    version = value.get("version")
    if version is not None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise _fail(source, f"{where}.version", f"an integer >= 1, got {version!r}")
    modality = value.get("modality")
    if modality is not None:
        if isinstance(modality, str):
            modality = [modality]
        if not isinstance(modality, list) or not modality or not all(
                isinstance(m, str) and _MODALITY.fullmatch(m.upper()) for m in modality):
            raise _fail(source, f"{where}.modality", f"DICOM Modality values such as [\"CT\"], got "
                                                     f"{ascii(modality)[:80]}")
        modality = tuple(m.upper() for m in modality)
    dataset_json = value.get("dataset_json")
    if dataset_json is not None:
        if not isinstance(dataset_json, str) or not dataset_json:
            raise _fail(source, f"{where}.dataset_json", f"a path, got {ascii(dataset_json)[:80]}")
        dataset_json = Path(dataset_json)
        if base is not None and not dataset_json.is_absolute():
            dataset_json = base / dataset_json
    output = value.get("output")
    if output is not None:
        output = DicomOutput.parse(output, where=f"{source}: {where}.output")
    if "comment" in value and not isinstance(value["comment"], str):
        raise _fail(source, f"{where}.comment", "a string")
    return ModelSettings(version, modality, dataset_json, output)
