"""Typed, frozen description of one trained nnU-Net model configuration.

Built from ``plans.json`` + ``dataset.json`` + the checkpoints' metadata, the way
``nnUNetPredictor.initialize_from_trained_model_folder`` (nnunetv2/inference/predict_from_raw_data.py)
and ``PlansManager`` / ``ConfigurationManager`` / ``LabelManager``
(nnunetv2/utilities/plans_handling/plans_handler.py, nnunetv2/utilities/label_handling/label_handling.py)
read them. Everything later stages need is here, so Triton models load one JSON file
(:meth:`InferenceConfig.to_json`) instead of nnU-Net's untyped dicts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.errors import PlansError, UnsupportedModelError
from nnunet_triton.numerics.releases import DEFAULT_NUMERICS, release_numerics

__all__ = [
    "IntensityProperties",
    "ChannelNormalization",
    "ResamplingSettings",
    "LabelSettings",
    "NetworkSettings",
    "InferenceConfig",
]

SUPPORTED_RESAMPLING_FUNCTIONS = ("resample_data_or_seg_to_shape",)


@dataclass(frozen=True)
class IntensityProperties:
    """Foreground intensity statistics of one input channel over the training set (plans.json)."""

    mean: float
    median: float
    std: float
    min: float
    max: float
    percentile_00_5: float
    percentile_99_5: float

    @classmethod
    def from_plans(cls, props: Mapping[str, Any]) -> IntensityProperties:
        try:
            return cls(**{name: float(props[name]) for name in cls.__dataclass_fields__})
        except KeyError as exc:
            raise PlansError(
                f"plans.json foreground_intensity_properties_per_channel: missing key {exc.args[0]!r} "
                f"(got keys {sorted(props)})."
            ) from None


@dataclass(frozen=True)
class ChannelNormalization:
    """How one input channel is normalized (``normalization_schemes[c]``, ``use_mask_for_norm[c]``)."""

    scheme: str
    use_mask_for_norm: bool
    intensity: IntensityProperties | None


@dataclass(frozen=True)
class ResamplingSettings:
    """``resampling_fn_*`` and its kwargs from a plans configuration."""

    function: str
    is_seg: bool
    order: int
    order_z: int
    force_separate_z: bool | None

    @classmethod
    def from_plans(cls, config: Mapping[str, Any], key: str) -> ResamplingSettings:
        function = config.get(key)
        if function not in SUPPORTED_RESAMPLING_FUNCTIONS:
            raise UnsupportedModelError(
                f"plans.json configuration setting {key!r} = {function!r} is not supported; "
                f"supported: {list(SUPPORTED_RESAMPLING_FUNCTIONS)}."
            )
        kwargs = dict(config.get(f"{key}_kwargs") or {})
        known = {"is_seg", "order", "order_z", "force_separate_z"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UnsupportedModelError(
                f"plans.json configuration setting {key}_kwargs has unsupported keys {unknown}."
            )
        return cls(
            function=function,
            is_seg=bool(kwargs.get("is_seg", False)),
            order=int(kwargs.get("order", 3)),
            order_z=int(kwargs.get("order_z", 0)),
            # resample_data_or_seg_to_shape's own default is False (no separate z), not None (auto).
            force_separate_z=kwargs.get("force_separate_z", False),
        )


@dataclass(frozen=True)
class LabelSettings:
    """Labels or regions, as nnU-Net's ``LabelManager`` derives them from dataset.json."""

    label_names: tuple[tuple[str, int | tuple[int, ...]], ...]
    all_labels: tuple[int, ...]
    has_regions: bool
    foreground_regions: tuple[tuple[int, ...], ...] | None
    regions_class_order: tuple[int, ...] | None
    ignore_label: int | None

    @property
    def foreground_labels(self) -> tuple[int, ...]:
        return tuple(label for label in self.all_labels if label != 0)

    @property
    def num_segmentation_heads(self) -> int:
        if self.has_regions:
            return len(self.foreground_regions or ())
        return len(self.all_labels)

    @property
    def max_label(self) -> int:
        values = self.regions_class_order if self.has_regions else self.all_labels
        return max(values or (0,))

    @classmethod
    def from_dataset(cls, dataset: Mapping[str, Any]) -> LabelSettings:
        labels = dataset.get("labels")
        if not isinstance(labels, Mapping) or "background" not in labels:
            raise PlansError(f"dataset.json 'labels' must be a mapping with 'background': 0, got {labels!r}.")
        if labels["background"] != 0:
            raise PlansError(f"dataset.json label 'background' must be 0, got {labels['background']!r}.")
        names: list[tuple[str, int | tuple[int, ...]]] = []
        for name, value in labels.items():
            parsed = tuple(int(v) for v in value) if isinstance(value, list | tuple) else int(value)
            names.append((name, parsed))
        has_regions = any(isinstance(v, tuple) and len(v) > 1 for _, v in names)
        ignore = labels.get("ignore")
        if ignore is not None and not isinstance(ignore, int):
            raise PlansError(f"dataset.json label 'ignore' must be an integer, got {ignore!r}.")
        all_labels = sorted(
            {v for n, val in names if n != "ignore" for v in (val if isinstance(val, tuple) else (val,))}
        )
        if ignore is not None and ignore != max(all_labels) + 1:
            raise PlansError(
                f"dataset.json label 'ignore' must be the highest label ({max(all_labels) + 1}), "
                f"got {ignore}."
            )
        regions = None
        order = dataset.get("regions_class_order")
        if has_regions:
            regions = tuple(
                v if isinstance(v, tuple) else (v,)
                for n, v in names
                if n != "ignore" and set(v if isinstance(v, tuple) else (v,)) != {0}
            )
            if order is None or len(order) != len(regions):
                raise PlansError(
                    f"dataset.json 'regions_class_order' must list one label per region ({len(regions)}), "
                    f"got {order!r}."
                )
        if not has_regions and all_labels != list(range(len(all_labels))):
            raise PlansError(f"dataset.json labels must be consecutive 0..K-1, got {all_labels}.")
        return cls(
            label_names=tuple(names),
            all_labels=tuple(all_labels),
            has_regions=has_regions,
            foreground_regions=regions,
            regions_class_order=tuple(int(o) for o in order) if has_regions and order is not None else None,
            ignore_label=ignore,
        )


@dataclass(frozen=True)
class NetworkSettings:
    """What is needed to rebuild the network exactly as the trainer does."""

    trainer_name: str
    network_class_name: str
    arch_kwargs_json: str  # JSON text (kept as text so the dataclass stays hashable)
    kw_requires_import: tuple[str, ...]
    num_input_channels: int
    num_output_channels: int

    @property
    def arch_kwargs(self) -> dict[str, Any]:
        return json.loads(self.arch_kwargs_json)


@dataclass(frozen=True)
class InferenceConfig:
    """Everything inference needs about one trained configuration, in nnU-Net's vocabulary.

    Spatial tuples (``patch_size``, ``spacing``) are in the *transposed* axis order used inside
    nnU-Net; ``transpose_forward`` maps the reader's axis order to it.
    """

    dataset_name: str
    plans_name: str
    configuration: str
    patch_size: tuple[int, ...]
    spacing: tuple[float, ...]
    transpose_forward: tuple[int, ...]
    transpose_backward: tuple[int, ...]
    normalization: tuple[ChannelNormalization, ...]
    resampling_data: ResamplingSettings
    resampling_seg: ResamplingSettings
    resampling_probabilities: ResamplingSettings
    network: NetworkSettings
    labels: LabelSettings
    mirror_axes: tuple[int, ...] | None
    folds: tuple[int | str, ...]
    channel_names: tuple[str, ...]
    image_reader_writer: str
    file_ending: str
    previous_stage: str | None = None
    numerics: str = DEFAULT_NUMERICS  # the nnU-Net release whose inference arithmetic to reproduce

    def __post_init__(self) -> None:
        release_numerics(self.numerics)  # an unknown name is refused here, naming the choices

    @property
    def num_input_channels(self) -> int:
        """Image channels the request carries (``channel_names``); see :attr:`num_previous_stage_channels`."""
        return len(self.channel_names)

    @property
    def num_previous_stage_channels(self) -> int:
        """One-hot channels of the previous stage's segmentation a cascade network takes after the image.

        ``len(label_manager.foreground_labels)`` for a cascade stage, 0 otherwise
        (``determine_num_input_channels``, nnunetv2/utilities/label_handling/label_handling.py); the
        network's input channels are ``num_input_channels + num_previous_stage_channels``
        (``network.num_input_channels``).
        """
        return len(self.labels.foreground_labels) if self.previous_stage is not None else 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InferenceConfig:
        d = dict(data)

        def tup(value: Any) -> Any:
            if isinstance(value, list):
                return tuple(tup(v) for v in value)
            return value

        d["normalization"] = tuple(
            ChannelNormalization(
                scheme=n["scheme"],
                use_mask_for_norm=n["use_mask_for_norm"],
                intensity=IntensityProperties(**n["intensity"]) if n["intensity"] is not None else None,
            )
            for n in d["normalization"]
        )
        for key in ("resampling_data", "resampling_seg", "resampling_probabilities"):
            d[key] = ResamplingSettings(**d[key])
        net = dict(d["network"])
        net["kw_requires_import"] = tup(net["kw_requires_import"])
        d["network"] = NetworkSettings(**net)
        lab = {k: tup(v) for k, v in d["labels"].items()}
        d["labels"] = LabelSettings(**lab)
        for key in ("patch_size", "spacing", "transpose_forward", "transpose_backward", "folds",
                    "channel_names"):
            d[key] = tup(d[key])
        d["mirror_axes"] = tup(d["mirror_axes"]) if d["mirror_axes"] is not None else None
        d.pop("extra", None)  # an unused field of repositories built before 0.1.0's layout change
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> InferenceConfig:
        return cls.from_dict(json.loads(text))

    def save(self, version_dir: Path) -> None:
        """Write ``<version_dir>/inference_config.json``, next to a Python model's ``model.py``."""
        (Path(version_dir) / io_names.INFERENCE_CONFIG_FILE).write_text(self.to_json())

    @classmethod
    def load(cls, version_dir: Path) -> InferenceConfig:
        """Read what :meth:`save` wrote (a ``model.py`` passes its own folder)."""
        return cls.from_json((Path(version_dir) / io_names.INFERENCE_CONFIG_FILE).read_text())
