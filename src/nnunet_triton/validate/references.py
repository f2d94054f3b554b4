"""Reference sets (the MHub pattern): the endpoint's answers, stored with what produced them.

Layout of a reference set folder::

    reference.json      format, creation time, versions, the deployment's description, the request
                        options, and per case: input hash, spacing, shape, file name and file hash
    <case>.npz          ``segmentation`` (+ ``probabilities`` when recorded with them)

``reference.json`` is written last and the folder appears under its name only when complete (it is
built as a hidden sibling and renamed), so a half-written set is never taken for a complete one.
Comparing against a set needs no nnU-Net: :class:`RecordedReference` refuses a set of another model
or other options (naming them), reports a case whose input changed instead of comparing it, and a
case file whose hash no longer matches (edited after recording).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError
from nnunet_triton.options import OPTION_FOLDS, RequestOptions
from nnunet_triton.util.hashing import sha256_file

__all__ = ["FORMAT", "IDENTITY_KEYS", "input_hash", "ReferenceWriter", "RecordedReference", "ReferenceError"]

FORMAT = "nnunet-triton-reference/1"
MANIFEST = "reference.json"
# what makes two deployments "the same model" (the endpoint's published description)
IDENTITY_KEYS = ("dataset_name", "plans_name", "configuration", "trainer_name", "labels",
                 "regions_class_order", "patch_size", "spacing")
MEANING_KEYS = ("labels", "regions_class_order")  # what an answer means: equal even across model versions
FOLDS_OPTION = OPTION_FOLDS


class ReferenceError(InputValidationError):
    """A reference set that cannot be used as asked (missing, malformed, another model or options)."""


def input_hash(image: np.ndarray, spacing: Any) -> str:
    """sha256 of an image (dtype, shape, bytes) and its spacing: what the endpoint was sent."""
    digest = hashlib.sha256()
    array = np.ascontiguousarray(image)
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes())
    digest.update(np.asarray(spacing, dtype=np.float64).tobytes())
    return digest.hexdigest()


def _safe_name(case: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in case) or "case"


@dataclass
class ReferenceWriter:
    """Record a reference set into ``folder`` (which must not exist yet); ``close()`` publishes it."""

    folder: Path
    deployment: Mapping[str, Any]
    options: Mapping[str, Any]
    versions: Mapping[str, Any]
    _cases: dict[str, dict[str, Any]] = field(default_factory=dict)
    _staging: Path | None = None

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        if self.folder.exists():
            raise ReferenceError(f"--record {self.folder}: the folder exists; record into a new folder "
                                 "(a reference set is never overwritten).")
        hidden = f".{self.folder.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        self._staging = self.folder.parent / hidden
        self._staging.mkdir(parents=True)

    def add(self, case: str, image: np.ndarray, spacing: Any, segmentation: np.ndarray,
            probabilities: np.ndarray | None = None) -> None:
        assert self._staging is not None
        name = f"{_safe_name(case)}.npz"
        arrays = {"segmentation": segmentation}
        if probabilities is not None:
            arrays["probabilities"] = probabilities
        np.savez_compressed(self._staging / name, **arrays)
        self._cases[case] = {"input_sha256": input_hash(image, spacing), "file": name,
                             "sha256": sha256_file(self._staging / name),
                             "spacing": [float(s) for s in spacing], "shape": list(segmentation.shape)}

    def close(self) -> Path:
        """Write ``reference.json`` and rename the set into place; returns the folder."""
        assert self._staging is not None
        manifest = {"format": FORMAT, "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                    "versions": dict(self.versions), "deployment": dict(self.deployment),
                    "options": dict(self.options), "cases": self._cases}
        (self._staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(self._staging, self.folder)
        self._staging = None
        return self.folder

    def discard(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None


@dataclass(frozen=True)
class RecordedReference:
    """A recorded reference set, checked against the deployment and options it is compared with."""

    folder: Path
    manifest: Mapping[str, Any]

    @classmethod
    def open(cls, folder: str | Path) -> RecordedReference:
        folder = Path(folder)
        path = folder / MANIFEST
        if not path.is_file():
            raise ReferenceError(f"--against {folder}: no {MANIFEST} (not a reference set, or an "
                                 "incomplete one).")
        try:
            manifest = json.loads(path.read_text())
        except ValueError as exc:
            raise ReferenceError(f"--against {folder}: {MANIFEST} is not valid JSON ({exc}).") from None
        if manifest.get("format") != FORMAT:
            raise ReferenceError(f"--against {folder}: format {manifest.get('format')!r}, "
                                 f"expected {FORMAT!r}.")
        return cls(folder, manifest)

    @property
    def options(self) -> Mapping[str, Any]:
        return self.manifest["options"]

    @property
    def cases(self) -> Mapping[str, Mapping[str, Any]]:
        return self.manifest["cases"]

    def check_compatible(self, deployment: Mapping[str, Any], options: Mapping[str, Any], *,
                         allow_model_change: bool = False) -> list[str]:
        """Refuse a set of another model or recorded with other request options, naming the difference.

        ``allow_model_change`` accepts another training of the same labels (a new endpoint version, other
        plans or trainer) and returns the differences; the labels and regions, which say what an answer
        means, must always be equal.
        """
        recorded = self.manifest.get("deployment", {})
        differing = [k for k in IDENTITY_KEYS if recorded.get(k) != deployment.get(k)]
        model = [f"{k}: recorded {recorded.get(k)!r}, served {deployment.get(k)!r}" for k in differing]
        meaning = [m for m, k in zip(model, differing, strict=True) if k in MEANING_KEYS]
        if meaning or (model and not allow_model_change):
            hint = "" if meaning else " (a new version of the same labels: --allow-model-change)"
            raise ReferenceError(f"--against {self.folder}: the reference set is of another model ("
                                 + "; ".join(meaning or model) + f"){hint}.")
        # an option recorded before it existed was recorded at its default
        recorded_options = {**RequestOptions().to_dict(), **self.options}
        changed = [f"{k}: recorded {recorded_options.get(k)!r}, now {v!r}" for k, v in options.items()
                   if recorded_options.get(k) != v]
        if allow_model_change:  # another version may have other folds: it answers with all of its own
            model += [c for c in changed if c.startswith(f"{FOLDS_OPTION}:")]
            changed = [c for c in changed if not c.startswith(f"{FOLDS_OPTION}:")]
        if changed:
            folds = any(c.startswith(f"{FOLDS_OPTION}:") for c in changed)
            hint = " (a new version with other folds: --allow-model-change)" if folds else ""
            raise ReferenceError(f"--against {self.folder}: the options differ from the recording ("
                                 + "; ".join(changed) + "); compare with the recorded options or "
                                 f"record anew{hint}.")
        return model

    def answer(self, case: str, image: np.ndarray, spacing: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """The recorded answer for ``case``; ReferenceError when the case is not in the set, its input
        changed, or its file was changed after recording."""
        entry = self.cases.get(case)
        if entry is None:
            raise ReferenceError(f"case {case!r} is not in the reference set {self.folder}.")
        if input_hash(image, spacing) != entry["input_sha256"]:
            raise ReferenceError(f"case {case!r}: the input differs from the recorded one (sha256 "
                                 f"{entry['input_sha256'][:12]}...); not compared.")
        path = self.folder / entry["file"]
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            raise ReferenceError(f"case {case!r}: {path.name} was changed or removed after recording "
                                 "(sha256 mismatch); the reference set cannot be trusted.")
        with np.load(path) as data:
            probabilities = data["probabilities"] if "probabilities" in data.files else None
            return data["segmentation"], probabilities
