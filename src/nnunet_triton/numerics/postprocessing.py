"""nnU-Net's postprocessing (``postprocessing.pkl``) on the exported segmentation, NumPy or CuPy.

``nnUNetv2_find_best_configuration`` runs ``determine_postprocessing``
(``nnunetv2/postprocessing/remove_connected_components.py``, v2.8.1), which pickles
``(pp_fns, pp_fn_kwargs)``: a list of functions and one kwargs dict per function. nnU-Net 2.8.1 only
ever chooses ``remove_all_but_largest_component_from_segmentation`` with ``labels_or_regions`` = all
foreground labels (one step that treats them as one mask) and/or one label or region per step.
``nnUNetv2_apply_postprocessing`` applies them in order to the segmentation in the original geometry.

Here the pickle is read once, at build time, with an unpickler that refuses every global except that
one function (the pickle never runs code), and turned into a typed :class:`PostprocessingPlan`
stored as JSON in the model repository. At serving time :func:`apply_postprocessing` reproduces
``remove_all_but_largest_component_from_segmentation`` exactly: the mask of the given labels/regions,
connected components with full connectivity (``skimage.measure.label(connectivity=None)`` in
``acvl_utils.morphology.morphology_helper.remove_all_but_largest_component``), every component of the
largest size kept (ties keep all), the other mask voxels set to ``background_label``.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.errors import PlansError, UnsupportedModelError
from nnunet_triton.numerics._xp import get_array_module, get_ndimage

__all__ = [
    "POSTPROCESSING_FILE",
    "LARGEST_COMPONENT_FUNCTION",
    "PostprocessingStep",
    "PostprocessingPlan",
    "load_postprocessing_pkl",
    "find_postprocessing_pkl",
    "load_deployed_postprocessing",
    "apply_postprocessing",
    "keep_largest_component",
]

POSTPROCESSING_FILE = "postprocessing.json"  # next to stitch_model's model.py in a built repository
LARGEST_COMPONENT_FUNCTION = "remove_all_but_largest_component_from_segmentation"
_FUNCTION_MODULE = "nnunetv2.postprocessing.remove_connected_components"
# numpy scalars (np.int64 labels) pickle through these two globals; nothing else is allowed.
_NUMPY_SCALAR_GLOBALS = {
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "dtype"),
}

LabelOrRegion = int | tuple[int, ...]


@dataclass(frozen=True)
class PostprocessingStep:
    """One ``remove_all_but_largest_component_from_segmentation`` call.

    Attributes:
        labels_or_regions: the members whose union forms ONE mask (nnU-Net's list argument); each member is
            a label or a region (tuple of labels).
        background_label: value written where a removed component was.
    """

    labels_or_regions: tuple[LabelOrRegion, ...]
    background_label: int = 0

    def member_labels(self) -> tuple[int, ...]:
        """Every label value that belongs to the mask, sorted."""
        values: set[int] = set()
        for member in self.labels_or_regions:
            values.update(member if isinstance(member, tuple) else (member,))
        return tuple(sorted(values))


@dataclass(frozen=True)
class PostprocessingPlan:
    """The steps of a ``postprocessing.pkl`` in order, and where they came from."""

    steps: tuple[PostprocessingStep, ...]
    source: str = ""

    def to_json(self) -> str:
        return json.dumps({
            "source": self.source,
            "steps": [{"function": LARGEST_COMPONENT_FUNCTION,
                       "labels_or_regions": [list(m) if isinstance(m, tuple) else m
                                             for m in s.labels_or_regions],
                       "background_label": s.background_label} for s in self.steps],
        }, indent=2)

    @classmethod
    def from_json(cls, text: str) -> PostprocessingPlan:
        data = json.loads(text)
        steps = []
        for index, step in enumerate(data.get("steps", [])):
            if step.get("function") != LARGEST_COMPONENT_FUNCTION:
                raise PlansError(
                    f"postprocessing.json step {index}: unknown function {step.get('function')!r}."
                )
            members = tuple(tuple(m) if isinstance(m, list) else int(m) for m in step["labels_or_regions"])
            steps.append(PostprocessingStep(members, int(step.get("background_label", 0))))
        return cls(tuple(steps), str(data.get("source", "")))


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only nnU-Net's largest-component function (as a name) and numpy scalars."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (_FUNCTION_MODULE, LARGEST_COMPONENT_FUNCTION):
            return _FunctionRef(name)
        if (module, name) in _NUMPY_SCALAR_GLOBALS:
            return super().find_class(module, name)
        raise UnsupportedModelError(
            f"postprocessing.pkl references {module}.{name}; only nnU-Net's "
            f"{_FUNCTION_MODULE}.{LARGEST_COMPONENT_FUNCTION} is supported (nnU-Net 2.8.1 chooses no other)."
        )


@dataclass(frozen=True)
class _FunctionRef:
    name: str


def _member(value: Any, where: str) -> LabelOrRegion:
    if isinstance(value, (list, tuple)):
        return tuple(_label(v, where) for v in value)
    return _label(value, where)


def _label(value: Any, where: str) -> int:
    try:
        as_int = int(value)
    except (TypeError, ValueError):
        raise PlansError(f"{where}: label {value!r} is not an integer.") from None
    if as_int != value or as_int < 0:
        raise PlansError(f"{where}: label {value!r} must be a non-negative integer.")
    return as_int


def _step(function: Any, kwargs: Any, index: int, path: str) -> PostprocessingStep:
    where = f"postprocessing.pkl {path!r} step {index}"
    if not isinstance(function, _FunctionRef):
        raise UnsupportedModelError(f"{where}: {function!r} is not a postprocessing function.")
    if not isinstance(kwargs, dict) or "labels_or_regions" not in kwargs:
        raise PlansError(f"{where}: kwargs must be a dict with 'labels_or_regions', got {kwargs!r}.")
    unknown = sorted(set(kwargs) - {"labels_or_regions", "background_label"})
    if unknown:
        raise UnsupportedModelError(f"{where}: unsupported kwargs {unknown}.")
    value = kwargs["labels_or_regions"]
    # nnU-Net: `if not isinstance(labels_or_regions, list): labels_or_regions = [labels_or_regions]`,
    # so a tuple is ONE region, a list is a union of members.
    members = tuple(_member(v, where) for v in value) if isinstance(value, list) else (_member(value, where),)
    return PostprocessingStep(members, _label(kwargs.get("background_label", 0), where))


def load_postprocessing_pkl(path: str | Path) -> PostprocessingPlan:
    """Read nnU-Net's ``postprocessing.pkl`` without executing code from it.

    Raises:
        PlansError: the file is missing or not nnU-Net's ``(functions, kwargs)`` pair.
        UnsupportedModelError: it names a function other than nnU-Net's largest-component filter.
    """
    path = Path(path)
    if not path.is_file():
        raise PlansError(f"postprocessing file {str(path)!r} does not exist.")
    try:
        content = _RestrictedUnpickler(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError) as exc:
        raise PlansError(f"postprocessing file {str(path)!r} is not a readable pickle: {exc}.") from None
    if not (isinstance(content, (tuple, list)) and len(content) == 2):
        raise PlansError(
            f"postprocessing file {str(path)!r} must hold (pp_fns, pp_fn_kwargs), "
            f"got {type(content).__name__}."
        )
    functions, kwargs = content
    if len(functions) != len(kwargs):
        raise PlansError(
            f"postprocessing file {str(path)!r}: {len(functions)} functions but {len(kwargs)} kwargs."
        )
    steps = tuple(_step(f, k, i, str(path)) for i, (f, k) in enumerate(zip(functions, kwargs, strict=True)))
    return PostprocessingPlan(steps, source=path.name)


def find_postprocessing_pkl(model_dir: str | Path, folds: Sequence[int | str]) -> Path | None:
    """``<model>/crossval_results_folds_<folds>/postprocessing.pkl`` (where nnU-Net writes it), if present.

    The folder name joins the folds with ``_`` (``folds_tuple_to_string``); only the pkl determined on
    exactly the deployed folds is picked up automatically.
    """
    folder = f"crossval_results_folds_{'_'.join(str(f) for f in folds)}"
    candidate = Path(model_dir) / folder / "postprocessing.pkl"
    return candidate if candidate.is_file() else None


def load_deployed_postprocessing(model_version_dir: str | Path) -> PostprocessingPlan | None:
    """The ``postprocessing.json`` the builder put next to a model's ``model.py``, or None."""
    path = Path(model_version_dir) / POSTPROCESSING_FILE
    return PostprocessingPlan.from_json(path.read_text()) if path.is_file() else None


def keep_largest_component(mask: Any) -> Any:
    """Boolean array: the mask's connected components (full connectivity) of the largest size."""
    xp = get_array_module(mask)
    ndimage = get_ndimage(xp)
    structure = xp.ones((3,) * mask.ndim, dtype=bool)
    labeled, count = ndimage.label(mask, structure=structure)
    if int(count) == 0:
        return xp.zeros(mask.shape, dtype=bool)
    sizes = xp.bincount(labeled.ravel())
    sizes[0] = 0
    largest = sizes == sizes.max()
    return largest[labeled]


def apply_postprocessing(segmentation: Any, plan: PostprocessingPlan) -> Any:
    """``apply_postprocessing(segmentation, pp_fns, pp_fn_kwargs)`` for a :class:`PostprocessingPlan`.

    Returns a new array (the input is not modified), same dtype and shape.
    """
    xp = get_array_module(segmentation)
    out = segmentation
    for step in plan.steps:
        mask = xp.isin(out, xp.asarray(step.member_labels()))
        if out is segmentation:
            out = segmentation.copy()
        out[mask & ~keep_largest_component(mask)] = step.background_label
    return out if out is not segmentation else segmentation.copy()
