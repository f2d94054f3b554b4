"""Tensor and model names shared by the config generator, the model.py adapters and the clients.

Every name is defined once here. Python models use UPPER_SNAKE names; TorchScript fold models follow the
PyTorch backend's ``<name>__<index>`` rule.
"""

from __future__ import annotations

# --- public endpoint -------------------------------------------------------------------------------
ENDPOINT_MODEL = "nnunet"
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
