"""The per-request options of the ``nnunet`` endpoint: one type, their names, defaults and parser.

They travel as Triton *request parameters*: Triton 2.51 ensembles forward a request's parameters
unchanged to every composing model (checked on the embedded server over HTTP and gRPC), so the client
sets them once on the ``nnunet`` endpoint and preprocess, orchestrator and stitch all see them.
The client (which writes them) and the server models (which read them) both import this module; it
imports only ``errors``. Also the one boolean and integer parsers for config and request parameters.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nnunet_triton.errors import InputValidationError, NnunetTritonError

if TYPE_CHECKING:
    from nnunet_triton.numerics.plans import InferenceConfig

__all__ = [
    "OPTION_MIRRORING",
    "OPTION_TILE_STEP_SIZE",
    "OPTION_FOLDS",
    "OPTION_PROBABILITIES",
    "OPTION_POSTPROCESSING",
    "KNOWN_OPTIONS",
    "DEFAULT_TILE_STEP_SIZE",
    "DEFAULT_CLIENT_TIMEOUT_S",
    "Fold",
    "RequestOptions",
    "ProbabilitiesOutput",
    "check_tile_step_size",
    "parse_bool",
    "parse_int",
    "parse_fold_ids",
]

# Request parameter names (the public per-request options of the ``nnunet`` endpoint).
OPTION_MIRRORING = "mirroring"  # bool, default True (nnU-Net's use_mirroring)
OPTION_TILE_STEP_SIZE = "tile_step_size"  # float in (0, 1], default 0.5
OPTION_FOLDS = "folds"  # "0,1" / "all" / 0: subset of the deployed folds, averaged in the given order
OPTION_PROBABILITIES = "probabilities"  # bool, default False: stitch_model also returns PROBABILITIES
OPTION_POSTPROCESSING = "postprocessing"  # bool, default True: apply the deployed postprocessing.pkl (if any)
KNOWN_OPTIONS = (OPTION_MIRRORING, OPTION_TILE_STEP_SIZE, OPTION_FOLDS, OPTION_PROBABILITIES,
                 OPTION_POSTPROCESSING)
DEFAULT_TILE_STEP_SIZE = 0.5
# Seconds a client waits for one inference answer (NnunetClient, the command lines, the tools).
DEFAULT_CLIENT_TIMEOUT_S = 600.0

Fold = int | str



class ProbabilitiesOutput(enum.Enum):
    """When the stitch model returns PROBABILITIES: on request (default), always or never."""

    REQUEST = "request"
    ALWAYS = "always"
    NEVER = "never"


def parse_bool(name: str, value: Any, *, what: str = "request parameter",
               error: type[NnunetTritonError] = InputValidationError) -> bool:
    """``value`` as a bool: a bool, or the text ``true``/``false`` (any case, surrounding blanks ignored).

    The one rule for request parameters, config parameters and environment settings.

    Raises:
        error: anything else; the message names ``what`` ``name`` and the value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise error(f"{what} {name!r} must be a boolean (true/false), got {value!r}.")


def parse_int(name: str, value: Any, *, minimum: int | None = None, what: str = "config parameter",
              label: str | None = None, error: type[Exception] = InputValidationError) -> int:
    """``value`` (an int or its decimal text; not a bool) as an int, at least ``minimum`` if given.

    The one reading of integers in config parameters, environment settings and command-line options.

    Raises:
        error: not an integer, or below ``minimum``; the message names the setting (``what`` ``name``,
            or ``label`` as given, e.g. an environment variable), the rule and the value.
    """
    rule = {None: "an integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    subject = f"{what} {name!r}" if label is None else label
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        number = int(value.strip())
    if number is None or (minimum is not None and number < minimum):
        raise error(f"{subject} must be {rule}, got {value!r}.".lstrip())
    return number


def check_tile_step_size(tile_step_size: Any) -> float:
    """Return ``tile_step_size`` as float after checking nnU-Net's rule ``0 < step <= 1``."""
    try:
        step = float(tile_step_size)
    except (TypeError, ValueError):
        raise InputValidationError(
            f"tile_step_size must be a number in (0, 1], got {tile_step_size!r}."
        ) from None
    if not 0 < step <= 1:  # also rejects NaN
        raise InputValidationError(f"tile_step_size must be in (0, 1], got {tile_step_size!r}.")
    return step


@dataclass(frozen=True)
class RequestOptions:
    """The per-request options of the ``nnunet`` endpoint: one name and one default each, one type for
    the client, the CLI, validate and every server step.

    The client sends :meth:`to_parameters` as Triton request parameters; every step of the pipeline
    reads them back with :meth:`from_parameters`, which validates the wire values and resolves ``folds``
    against the deployed model.

    Attributes:
        mirroring: test-time mirroring over the checkpoint's allowed axes (no-op if there are none);
            nnU-Net's ``use_mirroring``.
        tile_step_size: sliding-window step as a fraction of the patch size, in (0, 1].
        folds: fold ids to run, in averaging order (a subset of the deployed folds); None = every
            deployed fold (resolved by :meth:`from_parameters`).
        probabilities: return PROBABILITIES (softmax/sigmoid, float32) next to SEGMENTATION.
        postprocessing: apply the repository's postprocessing (nnU-Net's ``postprocessing.pkl``) to
            SEGMENTATION; no effect when none was deployed. PROBABILITIES are never postprocessed (as in
            nnU-Net).

    Raises:
        InputValidationError: a value breaking its rule (named with the value).
    """

    mirroring: bool = True
    tile_step_size: float = DEFAULT_TILE_STEP_SIZE
    folds: tuple[Fold, ...] | None = None
    probabilities: bool = False
    postprocessing: bool = True

    def __post_init__(self) -> None:
        for name in (OPTION_MIRRORING, OPTION_PROBABILITIES, OPTION_POSTPROCESSING):
            object.__setattr__(self, name, parse_bool(name, getattr(self, name), what="option"))
        object.__setattr__(self, OPTION_TILE_STEP_SIZE, check_tile_step_size(self.tile_step_size))
        if self.folds is not None:
            object.__setattr__(self, OPTION_FOLDS, _fold_selection(self.folds))

    def to_parameters(self) -> dict[str, Any]:
        """The Triton request parameters that carry these options (``folds`` as ``"0,1"``, or absent)."""
        params: dict[str, Any] = {OPTION_MIRRORING: self.mirroring,
                                  OPTION_TILE_STEP_SIZE: self.tile_step_size,
                                  OPTION_PROBABILITIES: self.probabilities,
                                  OPTION_POSTPROCESSING: self.postprocessing}
        if self.folds is not None:
            params[OPTION_FOLDS] = ",".join(str(f) for f in self.folds)
        return params

    def to_dict(self) -> dict[str, Any]:
        """The options as plain JSON values (reports, recorded reference sets)."""
        return {OPTION_FOLDS: [str(f) for f in self.folds] if self.folds is not None else None,
                OPTION_MIRRORING: self.mirroring, OPTION_TILE_STEP_SIZE: self.tile_step_size,
                OPTION_PROBABILITIES: self.probabilities, OPTION_POSTPROCESSING: self.postprocessing}

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any], config: InferenceConfig) -> RequestOptions:
        """Validate the request parameters of one ``nnunet`` request against the deployed model.

        Args:
            params: ``json.loads(request.parameters())``; every key must be one of :data:`KNOWN_OPTIONS`
                (an unknown key is almost always a typo that would otherwise be ignored silently).
            config: the deployed model; its ``folds`` are the selectable folds (and the default).

        Raises:
            InputValidationError: unknown option or a value breaking its rule (the message names both).
        """
        unknown = sorted(set(params) - set(KNOWN_OPTIONS))
        if unknown:
            raise InputValidationError(
                f"unknown request parameters {unknown}; supported: {list(KNOWN_OPTIONS)}."
            )
        step: Any = params.get(OPTION_TILE_STEP_SIZE, DEFAULT_TILE_STEP_SIZE)
        if isinstance(step, bool) or not isinstance(step, int | float | str):
            raise InputValidationError(f"request parameter {OPTION_TILE_STEP_SIZE!r} must be a number in "
                                       f"(0, 1], got {step!r}.")
        try:
            step = check_tile_step_size(step)
        except InputValidationError:
            raise InputValidationError(
                f"request parameter {OPTION_TILE_STEP_SIZE!r} must be a number in (0, 1], got {step!r}."
            ) from None
        folds = (parse_fold_ids(params[OPTION_FOLDS], config.folds) if OPTION_FOLDS in params
                 else tuple(config.folds))
        defaults = cls()
        return cls(
            mirroring=parse_bool(OPTION_MIRRORING, params.get(OPTION_MIRRORING, defaults.mirroring)),
            tile_step_size=step,
            folds=folds,
            probabilities=parse_bool(OPTION_PROBABILITIES, params.get(OPTION_PROBABILITIES,
                                                                      defaults.probabilities)),
            postprocessing=parse_bool(OPTION_POSTPROCESSING, params.get(OPTION_POSTPROCESSING,
                                                                        defaults.postprocessing)),
        )


def _fold_id(token: Any) -> Fold:
    if isinstance(token, bool):
        raise ValueError(token)
    if isinstance(token, int):
        return token
    text = str(token).strip()
    if text.isdigit():
        return int(text)
    if text == "all":
        return text
    raise ValueError(token)


def _fold_selection(value: Any, *, name: str = OPTION_FOLDS) -> tuple[Fold, ...]:
    """A fold selection's syntax (``"0,1"``, ``"all"``, ``1`` or a sequence): ids, at least one, no twice.

    Raises:
        InputValidationError: empty, malformed or duplicate folds.
    """
    tokens = value.split(",") if isinstance(value, str) else (
        list(value) if isinstance(value, list | tuple) else [value]
    )
    try:
        folds = tuple(_fold_id(t) for t in tokens)
    except ValueError:
        raise InputValidationError(
            f"request parameter {name!r} must be a comma-separated list of fold ids (e.g. \"0,1\"), "
            f"got {value!r}."
        ) from None
    if not folds:
        raise InputValidationError(f"request parameter {name!r} must name at least one fold, got {value!r}.")
    duplicates = sorted({str(f) for f in folds if folds.count(f) > 1})
    if duplicates:
        raise InputValidationError(
            f"request parameter {name!r} lists folds {duplicates} twice, got {value!r}."
        )
    return folds


def parse_fold_ids(value: Any, available: Sequence[Fold], *, name: str = OPTION_FOLDS) -> tuple[Fold, ...]:
    """Parse a fold selection (``"0,1"``, ``"all"``, ``1`` or a sequence) against the deployed folds.

    Raises:
        InputValidationError: empty, malformed, duplicate or not-deployed folds.
    """
    folds = _fold_selection(value, name=name)
    missing = [f for f in folds if f not in tuple(available)]
    if missing:
        raise InputValidationError(
            f"request parameter {name!r}: folds {missing} are not deployed (available: {list(available)}), "
            f"got {value!r}."
        )
    return folds
