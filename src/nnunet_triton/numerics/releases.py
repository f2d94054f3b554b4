"""Which nnU-Net release's inference arithmetic to reproduce: one table, read once per model.

nnU-Net does not record which release trained or validated a model folder, and its releases answer the same
model differently (docs/numerics.md). Reading nnU-Net's inference code release by release (the PyPI sdists
from 2.0 to 2.8.1), the CPU answers differ in these places, each a small choice the numerics take as a value,
never as a release number:

==========  ============================  ===========  ==========  ============  ========  ===============
numerics    Gaussian map                  fold fusion  export in   labels from   inf       export spacing
==========  ============================  ===========  ==========  ============  ========  ===============
2.0         peak 1, NumPy float64->fp16   / n per fold float32     probabilities passes    reader order
2.1         as 2.0                        sum, / n     float32     probabilities passes    reader order
2.2         fp16 first, /max*1000 in fp16 sum, / n     float16     probabilities passes    reader order
            (2.1.2 and 2.2)
2.2.1       float64 /max*10, then fp16    sum, / n     float16     probabilities passes    reader order
2.3         as 2.2.1                      sum, / n     float16     probabilities error     reader order
2.4         float64 /=(max/10), then fp16 sum, / n     float16     probabilities error     reader order
2.5         as 2.4                        sum, / n     float16     probabilities error     transposed
2.8         as 2.4                        sum, / n     float16     logits        error     transposed
==========  ============================  ===========  ==========  ============  ========  ===============

- **Gaussian map** (``compute_gaussian`` in ``nnunetv2/inference/sliding_window_prediction.py``):
  :class:`GaussianRule`, computed by ``numerics.gaussian.compute_gaussian(rule=...)``.
- **Fold fusion** (the fold loop of ``predict_from_raw_data``): 2.0 divides the running sum by the number
  of folds after *every* fold (``prediction /= len(parameters)`` indented into the loop), so later folds
  weigh more; 2.1 moved it after the loop. ``sliding_window.FoldAverage(divide_each_fold=...)``.
- **Export in**: 2.0 and 2.1 cast the fold-averaged float16 logits to float32 before resampling them to
  the original geometry (``export_prediction_from_softmax``); from 2.2 they are resampled as float16.
- **Labels from**: up to 2.5.x the export applies the softmax/sigmoid and takes the argmax of the float32
  probabilities (``convert_probabilities_to_segmentation``); from 2.6.0 the argmax of the logits when no
  probabilities are asked for (and of the probabilities when they are). Two logits a float32 softmax rounds
  to one probability go to the first label there: on float16 logits this happens only when both are within
  about 1e-4 of each other and of zero, on the float32 logits of 2.0/2.1 at any one-ulp tie.
- **inf**: from 2.3 the stitched float16 logits are checked for ``inf`` and the prediction aborts; before,
  an overflow passes to the export. No release checks for NaN.
- **Export spacing**: before 2.5.1 the export passes ``properties['spacing']`` in the reader's axis order
  to the resampling (the slice axis of a 2D configuration, and the separate-z decision) where the logits
  are in the plans' transposed order; 2.5.1 transposes it first.

Releases whose behaviour is an upstream bug are served as asked, with the bug named (:attr:`warnings`):
2.0's fold fusion, 2.2's float16 Gaussian (``n_predictions`` overflow on large overlaps: NaN labels), and
the silent ``inf`` before 2.3.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from nnunet_triton.errors import InputValidationError

__all__ = [
    "DEFAULT_NUMERICS",
    "GaussianRule",
    "ReleaseNumerics",
    "RELEASES",
    "numerics_names",
    "release_numerics",
]


class GaussianRule(str, Enum):  # noqa: UP042 - StrEnum is 3.11; the image's stub runs 3.10
    """How a release turns the filtered delta into the float16 importance map."""

    PEAK1_NUMPY = "peak 1: float64 g / max, NumPy cast to float16"  # 2.0, 2.1
    FP16_PEAK1000 = "float16 first, then / max * 1000 in float16"  # 2.2
    PEAK10_MULTIPLY = "float64 g / max * 10, then torch cast to float16"  # 2.2.1 - 2.3.x
    PEAK10_DIVIDE = "float64 g /= (max / 10), then torch cast to float16"  # 2.4 -


@dataclass(frozen=True)
class ReleaseNumerics:
    """The CPU inference arithmetic of one range of nnU-Net releases (see the module's table).

    Attributes:
        name: the ``--numerics`` value (``2.8``, ``2.5`` ...).
        releases: the nnU-Net releases it reproduces, as text.
        gaussian: the importance map's rule.
        divide_each_fold: 2.0's fold fusion (divide the running sum after every fold).
        export_float32: resample the logits as float32 (2.0, 2.1) instead of float16.
        labels_from_probabilities: take the labels from the float32 probabilities, not the logits.
        inf_is_error: an ``inf`` in the stitched logits fails the request (2.3 and later).
        export_spacing_transposed: the export's spacings are in the transposed axis order (2.5.1 and later).
        warnings: the upstream bugs this arithmetic reproduces, one sentence each.
    """

    name: str
    releases: str
    gaussian: GaussianRule = GaussianRule.PEAK10_DIVIDE
    divide_each_fold: bool = False
    export_float32: bool = False
    labels_from_probabilities: bool = False
    inf_is_error: bool = True
    export_spacing_transposed: bool = True
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """The published description (``info``, the endpoint metadata, validate's report)."""
        return {"numerics": self.name, "releases": self.releases, "gaussian": self.gaussian.value,
                "fold_fusion": "divide after every fold" if self.divide_each_fold else "sum, then divide",
                "export_dtype": "float32" if self.export_float32 else "float16",
                "labels_from": "probabilities" if self.labels_from_probabilities else "logits",
                "inf": "error" if self.inf_is_error else "passes",
                "export_spacing": "transposed" if self.export_spacing_transposed else "reader order"}


_FOLD_BUG = ("nnU-Net 2.0 divides the fold sum by the number of folds after every fold (fixed in 2.1): "
             "later folds weigh more than earlier ones.")
_FP16_GAUSSIAN_BUG = ("nnU-Net 2.1.2 and 2.2 cast the raw Gaussian to float16 before scaling its peak to "
                      "1000 (fixed in 2.2.1): the weights lose precision and large overlaps overflow float16 "
                      "(NaN logits).")
_SILENT_INF_BUG = ("nnU-Net before 2.3 does not check the stitched float16 logits for inf: an overflow gives "
                   "wrong labels instead of an error.")

DEFAULT_NUMERICS = "2.8"

RELEASES: dict[str, ReleaseNumerics] = {
    numerics.name: numerics
    for numerics in (
        ReleaseNumerics("2.8", "2.6.0 - 2.8.1 (this project's reference: nnU-Net 2.8.1)"),
        ReleaseNumerics("2.5", "2.5.1 - 2.5.2", labels_from_probabilities=True),
        ReleaseNumerics("2.4", "2.4 - 2.4.2", labels_from_probabilities=True,
                        export_spacing_transposed=False),
        ReleaseNumerics("2.3", "2.3.1", gaussian=GaussianRule.PEAK10_MULTIPLY, labels_from_probabilities=True,
                        export_spacing_transposed=False),
        ReleaseNumerics("2.2.1", "2.2.1", gaussian=GaussianRule.PEAK10_MULTIPLY,
                        labels_from_probabilities=True, inf_is_error=False, export_spacing_transposed=False,
                        warnings=(_SILENT_INF_BUG,)),
        ReleaseNumerics("2.2", "2.1.2 - 2.2", gaussian=GaussianRule.FP16_PEAK1000,
                        labels_from_probabilities=True, inf_is_error=False, export_spacing_transposed=False,
                        warnings=(_FP16_GAUSSIAN_BUG, _SILENT_INF_BUG)),
        ReleaseNumerics("2.1", "2.1", gaussian=GaussianRule.PEAK1_NUMPY, export_float32=True,
                        labels_from_probabilities=True, inf_is_error=False, export_spacing_transposed=False,
                        warnings=(_SILENT_INF_BUG,)),
        ReleaseNumerics("2.0", "2.0", gaussian=GaussianRule.PEAK1_NUMPY, divide_each_fold=True,
                        export_float32=True, labels_from_probabilities=True, inf_is_error=False,
                        export_spacing_transposed=False, warnings=(_FOLD_BUG, _SILENT_INF_BUG)),
    )
}


def numerics_names() -> tuple[str, ...]:
    """The ``--numerics`` choices, newest first."""
    return tuple(RELEASES)


def release_numerics(name: str | None) -> ReleaseNumerics:
    """The arithmetic ``name`` stands for (None: the default, :data:`DEFAULT_NUMERICS`).

    Raises:
        InputValidationError: an unknown name, naming the choices.
    """
    key = DEFAULT_NUMERICS if name is None else str(name)
    try:
        return RELEASES[key]
    except KeyError:
        raise InputValidationError(
            f"numerics must be one of {list(RELEASES)} (the nnU-Net release whose inference arithmetic to "
            f"reproduce), got {name!r}.") from None
