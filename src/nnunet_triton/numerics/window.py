"""The sliding window's settings as one frozen value, and the seam where its merger is swapped.

nnU-Net spreads these over ``nnUNetPredictor``'s constructor (``tile_step_size``, ``use_gaussian``,
``use_mirroring``), the checkpoint (``inference_allowed_mirroring_axes``), the plans (``patch_size``), the
label manager (``num_segmentation_heads``) and ``compute_gaussian``'s defaults; MONAI's ``PatchInferer``
(``monai/inferers/inferer.py``) holds its splitter, merger class and batch size in one object. Here
:class:`SlidingWindowSettings` is that object: built and validated once (a value breaking a rule is refused
on construction with the field, the rule and the value), then handed whole to the input side
(``sliding_window.TileSplitter``), the output side (``sliding_window.TileMerger``) and the loops that drive
them (``sliding_window.predict_sliding_window`` and ``pipeline.orchestration.predict_fold_async`` /
``predict_folds_async``).

Where the tiles' arithmetic runs (NumPy, CuPy, or a torch tensor's device) is not a setting: it is the
data's, as it always was (the accumulators are allocated like the padded input).

The merger is swappable: ``merger`` names a :data:`MergerFactory`, called once per fold with the fold's
splitter and these settings, that returns a :class:`Merger`. ``TileMerger`` un-flips and TTA-averages each
tile's mirrored copies and hands every finished tile to it exactly once, in nnU-Net's tile order
(``tiling.tile_slicers``; fp16 sums are order-dependent); whatever :meth:`Merger.finalize` returns is the
fold's result. ``None`` (the default) is ``sliding_window.VolumeMerger``, nnU-Net's whole-volume float16
accumulation. A streaming merger that finalises slabs of the first spatial axis as soon as no later tile
touches them is another such factory.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics.gaussian import DEFAULT_SIGMA_SCALE, compute_gaussian
from nnunet_triton.numerics.releases import GaussianRule, release_numerics
from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE, check_tile_step_size

if TYPE_CHECKING:
    from nnunet_triton.numerics.plans import InferenceConfig
    from nnunet_triton.numerics.sliding_window import TileSplitter
    from nnunet_triton.options import RequestOptions

__all__ = ["Merger", "MergerFactory", "SlidingWindowSettings"]


@runtime_checkable
class Merger(Protocol):
    """The output side of one fold's sliding window, after un-flipping and TTA averaging.

    :meth:`add` is called once per tile, in nnU-Net's tile order; :meth:`finalize` once, after the last tile.
    """

    def add(self, tile: int, slicer: tuple[Any, ...], logits: Any) -> None:
        """Take tile number ``tile`` (its index in the tile order), placed at spatial ``slicer`` of the padded
        volume (``splitter.slicers[tile]``), with its TTA-averaged network output ``logits`` ``(K, *P)``."""

    def finalize(self) -> Any:
        """The fold's result: float16 logits ``(K, *spatial)`` of the unpadded volume for the default."""


MergerFactory = Callable[["TileSplitter", "SlidingWindowSettings"], Merger]


def _refuse(name: str, rule: str, value: Any) -> InputValidationError:
    return InputValidationError(f"sliding window setting {name!r} must be {rule}, got {value!r}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # NumPy integers too


def _count(name: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise _refuse(name, "an integer >= 1", value)
    return int(value)


def _patch_size(value: Any) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value or not all(
            _is_int(p) and p >= 1 for p in value):
        raise _refuse("patch_size", "a non-empty sequence of integers >= 1", value)
    return tuple(int(p) for p in value)


def _mirror_axes(value: Any, patch: tuple[int, ...]) -> tuple[int, ...] | None:
    if value is None:
        return None
    rule = f"None or distinct spatial axes in 0..{len(patch) - 1} for the {len(patch)}D patch {patch}"
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise _refuse("mirror_axes", rule, value)
    axes = tuple(value)
    if not all(_is_int(a) and 0 <= a < len(patch) for a in axes) or (
            len(set(axes)) != len(axes)):
        raise _refuse("mirror_axes", rule, value)
    return tuple(int(a) for a in axes) or None  # no axes: no TTA, one spelling


@dataclass(frozen=True)
class SlidingWindowSettings:
    """Everything that decides one fold's sliding window besides the data and the network.

    Attributes:
        patch_size: the configuration's patch size ``P`` (tile shape; one axis fewer than the data's
            spatial axes for a 2D configuration on 3D data).
        num_heads: ``K``, the network's outputs per voxel (``num_segmentation_heads``).
        mirror_axes: test-time mirroring over these spatial axes (0-based, distinct, each < ``len(P)``), or
            ``None`` for none; an empty sequence is stored as ``None``.
        tile_step_size: step between tiles as a fraction of ``P``, in (0, 1] (nnU-Net's ``tile_step_size``).
        use_gaussian: weight tiles by the Gaussian importance map (nnU-Net's default and only CLI choice);
            ``False`` weights every voxel of a tile by 1.
        sigma_scale: the map's ``sigma = P_d * sigma_scale`` (``compute_gaussian``), > 0.
        batch_size: network inputs per call; a tile's mirrored copies are extra inputs (nnU-Net: 1).
        max_inflight: network calls awaited at once by the asynchronous loops (the synchronous
            ``predict_sliding_window`` makes one at a time).
        gaussian: ``compute_gaussian(patch_size, sigma_scale=sigma_scale)`` computed once and reused (host
            or device array, float16, shape ``P``), or ``None`` to compute it per fold. A cache, not a
            setting: not part of equality or the repr.
        merger: the :data:`MergerFactory` of each fold's :class:`Merger`; ``None``: nnU-Net's whole-volume
            accumulation (``sliding_window.VolumeMerger``).
        gaussian_rule: how the release being reproduced scales and casts the map
            (``numerics.releases.GaussianRule``; default: nnU-Net 2.4 and later).
        inf_is_error: an ``inf`` in the stitched float16 logits fails the fold (nnU-Net 2.3 and later);
            ``False`` passes it on, as older releases do.

    Raises:
        InputValidationError: a field breaking its rule; the message names the field, the rule and the value.
    """

    patch_size: tuple[int, ...]
    num_heads: int
    mirror_axes: tuple[int, ...] | None = None
    tile_step_size: float = DEFAULT_TILE_STEP_SIZE
    use_gaussian: bool = True
    sigma_scale: float = DEFAULT_SIGMA_SCALE
    batch_size: int = 1
    max_inflight: int = 1
    gaussian: Any = field(default=None, compare=False, repr=False)
    merger: MergerFactory | None = None
    gaussian_rule: GaussianRule = GaussianRule.PEAK10_DIVIDE
    inf_is_error: bool = True

    def __post_init__(self) -> None:
        patch = _patch_size(self.patch_size)
        object.__setattr__(self, "patch_size", patch)
        object.__setattr__(self, "num_heads", _count("num_heads", self.num_heads))
        object.__setattr__(self, "mirror_axes", _mirror_axes(self.mirror_axes, patch))
        try:
            step = check_tile_step_size(self.tile_step_size)
        except InputValidationError:
            raise _refuse("tile_step_size", "a number in (0, 1]", self.tile_step_size) from None
        object.__setattr__(self, "tile_step_size", step)
        if not isinstance(self.use_gaussian, bool):
            raise _refuse("use_gaussian", "a bool", self.use_gaussian)
        sigma = self.sigma_scale
        if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not (
                math.isfinite(sigma) and sigma > 0):
            raise _refuse("sigma_scale", "a finite number > 0", sigma)
        object.__setattr__(self, "sigma_scale", float(sigma))
        object.__setattr__(self, "batch_size", _count("batch_size", self.batch_size))
        object.__setattr__(self, "max_inflight", _count("max_inflight", self.max_inflight))
        if self.gaussian is not None:
            shape = tuple(int(s) for s in getattr(self.gaussian, "shape", ()))
            if shape != patch or "float16" not in str(getattr(self.gaussian, "dtype", "")):
                raise _refuse("gaussian", f"None or a float16 map of shape patch_size {patch}",
                              f"{getattr(self.gaussian, 'dtype', type(self.gaussian).__name__)} {shape}")
        if self.merger is not None and not callable(self.merger):
            raise _refuse("merger", "None or a callable (splitter, settings) -> Merger", self.merger)
        try:
            object.__setattr__(self, "gaussian_rule", GaussianRule(self.gaussian_rule))
        except ValueError:
            raise _refuse("gaussian_rule", f"one of {[r.value for r in GaussianRule]}",
                          self.gaussian_rule) from None
        if not isinstance(self.inf_is_error, bool):
            raise _refuse("inf_is_error", "a bool", self.inf_is_error)

    @property
    def variants_per_tile(self) -> int:
        """Network inputs per tile: the identity plus one per non-empty subset of the mirror axes."""
        return 2 ** len(self.mirror_axes or ())

    def gaussian_map(self) -> Any:
        """The float16 importance map: :attr:`gaussian` if given, else computed (NumPy) from the settings."""
        if self.gaussian is not None:
            return self.gaussian
        return compute_gaussian(self.patch_size, sigma_scale=self.sigma_scale, rule=self.gaussian_rule)

    @classmethod
    def for_request(cls, config: InferenceConfig, options: RequestOptions, *, batch_size: int = 1,
                    max_inflight: int = 1, gaussian: Any = None,
                    merger: MergerFactory | None = None) -> SlidingWindowSettings:
        """The settings of one ``nnunet`` request: the deployed model's patch, heads, mirror axes (when
        ``options.mirroring``) and release numerics (``config.numerics``: the Gaussian's rule and the
        ``inf`` check), the request's tile step, and the caller's batching and cached map."""
        numerics = release_numerics(config.numerics)
        return cls(patch_size=tuple(config.patch_size), num_heads=config.labels.num_segmentation_heads,
                   mirror_axes=config.mirror_axes if options.mirroring else None,
                   tile_step_size=options.tile_step_size, batch_size=batch_size, max_inflight=max_inflight,
                   gaussian=gaussian, merger=merger, gaussian_rule=numerics.gaussian,
                   inf_is_error=numerics.inf_is_error)
