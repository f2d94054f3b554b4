"""Tensor and model names shared by the config generator, the model.py adapters and the clients.

Every name is defined once here. Python models use UPPER_SNAKE names; TorchScript fold models follow the
PyTorch backend's ``<name>__<index>`` rule.
"""

from __future__ import annotations

import re

# --- public endpoint -------------------------------------------------------------------------------
ENDPOINT_MODEL = "nnunet"  # the default endpoint name (``build`` without ``--endpoint``)
IMAGE = "IMAGE"  # [C, *spatial] in the training reader's axis order (SimpleITK: z, y, x)
SPACING = "SPACING"  # [n_spatial] float64, same axis order as IMAGE
SEGMENTATION = "SEGMENTATION"  # [*spatial] uint8/uint16, geometry of IMAGE
PROBABILITIES = "PROBABILITIES"  # [K, *spatial] float32, only when requested

# IMAGE travels in the client's own dtype. An ensemble input has one dtype and cannot be optional, so
# each dtype has its own endpoint over the same composing models: ``nnunet`` takes FP32, ``nnunet_int16``
# INT16 and so on; each maps IMAGE onto preprocess_model's optional input of that dtype (IMAGE for FP32,
# IMAGE_<DTYPE> otherwise), which converts it to float32 as nnU-Net's preprocessing does.
IMAGE_DTYPES = ("FP32", "FP16", "INT16", "UINT16", "UINT8")  # wire dtypes (numpy's: nnunet_triton.dtypes)


def image_input(dtype: str) -> str:
    """preprocess_model's IMAGE input for ``dtype`` (a Triton dtype name of ``IMAGE_DTYPES``)."""
    if dtype not in IMAGE_DTYPES:
        raise ValueError(f"IMAGE dtype must be one of {tuple(IMAGE_DTYPES)}, got {dtype!r}.")
    return IMAGE if dtype == "FP32" else f"{IMAGE}_{dtype}"


def typed_endpoint(dtype: str, endpoint: str = ENDPOINT_MODEL) -> str:
    """The endpoint that takes IMAGE in ``dtype``: ``nnunet`` for FP32, ``nnunet_int16`` for INT16, ..."""
    if dtype not in IMAGE_DTYPES:
        raise ValueError(f"IMAGE dtype must be one of {tuple(IMAGE_DTYPES)}, got {dtype!r}.")
    return endpoint if dtype == "FP32" else f"{endpoint}_{dtype.lower()}"

# Rate-limiter resource one fold-model execution holds on CPU servers; the thread budget
# (nnunet_triton.server.thread_budget) gives the server as many as may compute at once.
FOLD_SLOT_RESOURCE = "nnunet_fold_slot"

# --- files of a built repository --------------------------------------------------------------------
REPOSITORY_METADATA_FILE = "repository_metadata.json"  # at the repository root (Triton ignores it)
VERSION_DIR = "1"  # every model's only version
MODEL_CONFIG_FILE = "config.pbtxt"  # each model folder's Triton config (only repository.config opens it)
INFERENCE_CONFIG_FILE = "inference_config.json"  # InferenceConfig.to_json() next to each Python model.py
TORCHSCRIPT_FILE = "model.pt"  # a fold's TorchScript network

# --- composing models ------------------------------------------------------------------------------
PREPROCESS_MODEL = "preprocess_model"
ORCHESTRATOR_MODEL = "orchestrator_model"
STITCH_MODEL = "stitch_model"


def fold_model_name(fold: int | str) -> str:
    """Name of the Triton model serving one fold's network (``fold_0`` ... ``fold_all``)."""
    return f"fold_{fold}"


# preprocess -> orchestrator / stitch
PREPROCESSED = "PREPROCESSED"  # [C_in, *resampled spatial] float32, transposed axis order
CASE_PROPERTIES = "CASE_PROPERTIES"  # float64 vector, CaseProperties.to_array() / from_array()

# orchestrator -> stitch
LOGITS = "LOGITS"  # [K, *resampled spatial] float16, fold-averaged

# fold models (TorchScript naming convention of the PyTorch backend)
FOLD_INPUT = "INPUT__0"  # [N, C_in, *patch] float32
FOLD_OUTPUT = "OUTPUT__0"  # [N, K, *patch] float32 (float16 with fp16 export)

# --- cascades (3d_lowres -> 3d_cascade_fullres in one call) ---------------------------------------------
PREVIOUS_STAGE_PREFIX = "previous_stage_"  # the previous stage's models: previous_stage_preprocess_model, ...
# cascade preprocess_model input: the previous stage's SEGMENTATION
PREVIOUS_SEGMENTATION = "PREVIOUS_SEGMENTATION"

# --- ensembles of configurations (``nnUNetv2_ensemble`` behind the one endpoint) ----------------------
COMBINE_MODEL = "combine_model"  # averages the members' PROBABILITIES -> SEGMENTATION (+ PROBABILITIES)


def member_prefix(index: int) -> str:
    """Prefix of every composing model (and ensemble tensor) of ensemble member ``index``."""
    return f"member{index}_"


def member_probabilities(index: int) -> str:
    """combine_model input carrying member ``index``'s PROBABILITIES."""
    return f"{PROBABILITIES}_{index}"


# --- named endpoints and their versions (several nnU-Net models behind one server) -------------------
# A repository holds any number of endpoint names (``nnunet``, ``liver``, ...), each with versions 1, 2, ...
# Version N of name E is a whole pipeline whose composing models carry the namespace ``E__vN__``
# (``liver__v2__preprocess_model``, ``liver__v2__fold_0``) and whose own endpoint ``E__vN`` (+ typed
# copies ``E__vN_int16``, ...) is always the pinned way to call exactly that version. The public endpoint
# ``E`` (+ ``E_int16``, ...) is an ensemble with the steps of the promoted version; promoting rewrites it
# and loads it again (server.rollout). Version 1 of the default name ``nnunet`` keeps the names of a
# single-model repository (``preprocess_model``, ``fold_0``, ...), which dashboards and scripts know.
NAMESPACE_SEPARATOR = "__"
MAX_ENDPOINT_NAME_LENGTH = 48
_ENDPOINT_NAME = re.compile(r"^[a-z][a-z0-9-]*(_[a-z0-9-]+)*$")
_NAMESPACED = re.compile(r"^(?P<name>[a-z][a-z0-9_-]*?)__v(?P<version>[1-9][0-9]*)"
                         r"(?:__(?P<role>.+)|(?P<typed>_[a-z0-9]+)?)$")
# names a user's endpoint must not take: the unprefixed models of the default name's version 1
_RESERVED_PREFIXES = ("fold_", "member", "previous_stage_")
_RESERVED_NAMES = frozenset({"preprocess_model", "orchestrator_model", "stitch_model", "combine_model"})


def check_endpoint_name(name: str) -> str:
    """``name`` when it can name an endpoint; ValueError naming the rule otherwise.

    Rules: lowercase letters, digits, ``-`` and single ``_`` between them, starting with a letter, at most
    ``MAX_ENDPOINT_NAME_LENGTH`` characters; no ``__`` (the namespace separator), no typed-copy suffix
    (``_fp16``, ``_int16``, ``_uint16``, ``_uint8``: those are the typed endpoints of another name), and
    none of the default model's composing-model names.
    """
    if not isinstance(name, str) or not _ENDPOINT_NAME.match(name) or len(name) > MAX_ENDPOINT_NAME_LENGTH:
        raise ValueError(
            f"endpoint name must be lowercase letters, digits, '-' and single '_' between them, starting "
            f"with a letter, at most {MAX_ENDPOINT_NAME_LENGTH} characters, got {name!r}.")
    suffixes = tuple(f"_{dtype.lower()}" for dtype in IMAGE_DTYPES if dtype != "FP32")
    if name.endswith(suffixes):
        raise ValueError(f"endpoint name must not end in a typed-endpoint suffix {suffixes}: "
                         f"{name!r} would be a typed copy of {name.rsplit('_', 1)[0]!r}.")
    if name in _RESERVED_NAMES or name.startswith(_RESERVED_PREFIXES):
        raise ValueError(f"endpoint name {name!r} is reserved for the composing models of the default "
                         f"endpoint {ENDPOINT_MODEL!r} (names {sorted(_RESERVED_NAMES)} and prefixes "
                         f"{_RESERVED_PREFIXES}).")
    return name


def check_version(version: object) -> int:
    """``version`` as an int >= 1; ValueError otherwise."""
    if isinstance(version, bool) or not isinstance(version, int | str):
        raise ValueError(f"endpoint version must be an integer >= 1, got {version!r}.")
    try:
        value = int(version)
    except ValueError:
        raise ValueError(f"endpoint version must be an integer >= 1, got {version!r}.") from None
    if value < 1 or (isinstance(version, str) and version != str(value)):
        raise ValueError(f"endpoint version must be an integer >= 1, got {version!r}.")
    return value


def model_namespace(name: str, version: int) -> str:
    """Prefix of every composing model of version ``version`` of endpoint ``name`` (``liver__v2__``; ``""``
    for version 1 of the default name)."""
    if name == ENDPOINT_MODEL and version == 1:
        return ""
    return f"{name}{NAMESPACE_SEPARATOR}v{version}{NAMESPACE_SEPARATOR}"


def pinned_endpoint(name: str, version: int) -> str:
    """The endpoint that always runs version ``version`` of ``name``: ``liver__v2``."""
    return f"{name}{NAMESPACE_SEPARATOR}v{version}"


def public_endpoints(name: str) -> tuple[str, ...]:
    """``name`` and its typed copies (``liver``, ``liver_fp16``, ...): what promoting rewrites."""
    return tuple(typed_endpoint(dtype, name) for dtype in IMAGE_DTYPES)


def endpoint_of_model(model: str) -> tuple[str, int]:
    """(endpoint name, version) a model of a built repository belongs to: ``liver__v2__fold_0`` -> (liver, 2);
    ``liver__v2`` and its typed copies -> (liver, 2); an unprefixed composing model -> (``nnunet``, 1). A
    public endpoint (``liver``, ``nnunet_int16``) answers with the promoted version, which only the registry
    knows: (liver, 0)."""
    match = _NAMESPACED.match(model)
    if match:
        return match.group("name"), int(match.group("version"))
    base = model
    for dtype in IMAGE_DTYPES:
        if dtype != "FP32" and model.endswith(f"_{dtype.lower()}"):
            base = model[: -len(dtype) - 1]
    if _ENDPOINT_NAME.match(base) and base not in _RESERVED_NAMES and not base.startswith(_RESERVED_PREFIXES):
        return base, 0
    return ENDPOINT_MODEL, 1
