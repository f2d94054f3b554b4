"""Which DICOM series fit a model: the Modality its channels were trained on.

nnU-Net's dataset.json names each input channel (``channel_names``); the name picks the normalization, and
``CT`` means CT normalization (Hounsfield units). A single DICOM series is one channel, so a model with
several channels cannot take one; a one-channel model takes the Modality its channel name stands for:
``CT`` -> CT, MR names (``MR``, ``MRI``, ``T1``, ``T2``, ``FLAIR``, ``ADC``, ``DWI`` ...) -> MR,
``PET``/``PT`` -> PT. A name that stands for no Modality (``noNorm``, ``zscore``, a study-specific
name) gives no rule unless the operator states one (``--modality``): :func:`expected_modalities` returns
None and the caller says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nnunet_triton.errors import InputValidationError

__all__ = ["ModalityRule", "expected_modalities", "modality_rule"]

_KNOWN = {
    "CT": re.compile(r"^(ct|cta|ncct|cect)$"),
    "MR": re.compile(r"^(mr|mri|t1|t1w|t1c|t1ce|t1gd|t2|t2w|flair|adc|dwi|pd|pdw|swi|dce|bold)$"),
    "PT": re.compile(r"^(pet|pt|suv)$"),
}


def _modality_of(name: str) -> str | None:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    return next((modality for modality, rule in _KNOWN.items() if rule.match(key)), None)


def expected_modalities(channel_names: Mapping[str, str] | None) -> frozenset[str] | None:
    """The Modality values a model with these dataset.json ``channel_names`` takes; None when unknown."""
    if not channel_names:
        return None
    found = {_modality_of(str(name)) for name in channel_names.values()}
    return None if None in found else frozenset(m for m in found if m)


@dataclass(frozen=True)
class ModalityRule:
    """``allowed``: the Modality values a series may have (None: any); ``channels``: the model's inputs."""

    allowed: frozenset[str] | None
    channels: int = 1
    source: str = "the model's channel names"

    def refusal(self, modality: str) -> str:
        """Why a series of ``modality`` does not fit (``""`` when it does)."""
        if self.channels > 1:
            return (f"the model takes {self.channels} channels and a DICOM series is one; segment such "
                    "cases from files with one image per channel")
        if self.allowed is not None and modality not in self.allowed:
            return (f"Modality {modality or '(none)'} does not fit the model: {self.source} expect "
                    f"{'/'.join(sorted(self.allowed))}")
        return ""


def modality_rule(description: object | None, override: Iterable[str] | None = None) -> ModalityRule:
    """The rule for a served model (an ``EndpointDescription``); ``override`` (``--modality``) wins."""
    published = getattr(description, "published", None) or {}
    channels = max(1, int(getattr(description, "num_channels", 1) or 1))
    if override:
        values = frozenset(str(m).upper() for m in override)
        if any(not re.fullmatch(r"[A-Z]{2,16}", m) for m in values):
            raise InputValidationError(f"--modality takes DICOM Modality values such as CT or MR, got "
                                       f"{sorted(values)}.")
        return ModalityRule(values, channels, source="--modality")
    names = published.get("channel_names") if isinstance(published, Mapping) else None
    return ModalityRule(expected_modalities(names), channels)
