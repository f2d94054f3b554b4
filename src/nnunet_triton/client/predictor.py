"""``TritonPredictor``: nnU-Net's ``nnUNetPredictor`` API, running on the Triton ``nnunet`` endpoint.

An nnU-Net script switches to Triton by changing the constructor line::

    predictor = nnUNetPredictor(tile_step_size=0.5, use_mirroring=True, device=torch.device("cuda"))
    predictor = TritonPredictor(tile_step_size=0.5, use_mirroring=True, url="triton:8000")  # endpoint="liver"
    predictor.initialize_from_trained_model_folder(model_folder, use_folds=(0, 1))  # reads only the JSONs
    seg = predictor.predict_single_npy_array(image, {"spacing": spacing})

Argument meanings and return values follow nnunetv2/inference/predict_from_raw_data.py (nnU-Net 2.8.1).
The server does preprocessing, sliding window and export; images are read and segmentations written with
the model's own nnU-Net reader/writer (``plans['image_reader_writer']``), and the ``.pkl`` next to a
``.npz`` holds the image properties the reader returned (``spacing``, ``sitk_stuff``: enough for
``nnUNetv2_ensemble``), not the cropping details that stay on the server. Cascades (a previous stage's
segmentation) are not supported.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton import io_names
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.client.deprecation import renamed_keyword
from nnunet_triton.client.endpoint import describe_endpoint, segment_with_retry
from nnunet_triton.errors import InputValidationError, UnsupportedModelError
from nnunet_triton.options import DEFAULT_CLIENT_TIMEOUT_S, DEFAULT_TILE_STEP_SIZE
from nnunet_triton.parameters import DEFAULT_HTTP_PORT

__all__ = ["TritonPredictor", "DEFAULT_NUM_PROCESSES"]

LOGGER = logging.getLogger(__name__)
DEFAULT_NUM_PROCESSES = 8  # nnunetv2.configuration.default_num_processes (accepted, unused: the server works)


def _no_cascade(previous: Any) -> None:
    if previous is not None and not (isinstance(previous, list) and all(p is None for p in previous)):
        raise UnsupportedModelError(
            "TritonPredictor: a previous stage's segmentation cannot be passed in; cascades are served whole "
            "(build the cascade stage's folder: the endpoint runs the previous stage itself)."
        )


class TritonPredictor:
    """Drop-in for ``nnUNetPredictor``; the numerics happen on the server (``url``, ``protocol``).

    ``perform_everything_on_device``, ``device`` and ``verbose_preprocessing`` are accepted for compatibility
    and ignored (the deployment decides where it runs). ``use_gaussian=False`` is not served. ``endpoint``
    and ``version`` pick the endpoint as in :class:`NnunetClient` (``model`` is its deprecated spelling,
    kept for one release with a DeprecationWarning).
    """

    def __init__(
        self,
        tile_step_size: float = DEFAULT_TILE_STEP_SIZE,
        use_gaussian: bool = True,
        use_mirroring: bool = True,
        perform_everything_on_device: bool = True,
        device: Any = None,
        verbose: bool = False,
        verbose_preprocessing: bool = False,
        allow_tqdm: bool = True,
        *,
        url: str = f"127.0.0.1:{DEFAULT_HTTP_PORT}",
        protocol: str = "http",
        timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S,
        retries: int = 3,
        endpoint: str | None = None,
        version: int | None = None,
        model: str | None = None,
    ) -> None:
        if not use_gaussian:
            raise UnsupportedModelError(
                "TritonPredictor: the endpoint always uses Gaussian tile weighting (use_gaussian=True)."
            )
        self.tile_step_size, self.use_mirroring = tile_step_size, use_mirroring
        self.verbose, self.allow_tqdm, self.retries = verbose, allow_tqdm, retries
        endpoint = renamed_keyword("TritonPredictor", "model", model, "endpoint", endpoint)
        self.client = NnunetClient(url, protocol=protocol, timeout_s=timeout_s,
                                   endpoint=endpoint or io_names.ENDPOINT_MODEL, version=version)
        self.url, self.protocol = url, protocol
        self.use_folds: tuple[int | str, ...] | None = None
        self.dataset_json: dict[str, Any] | None = None
        self.plans: dict[str, Any] | None = None

    # --- initialization ------------------------------------------------------------------------------------

    def initialize_from_trained_model_folder(
        self,
        model_training_output_dir: str,
        use_folds: Sequence[int | str] | int | str | None,
        checkpoint_name: str = "checkpoint_final.pth",
    ) -> None:
        """Read ``dataset.json``/``plans.json`` of the folder (no checkpoints) and use ``use_folds`` of the
        deployed folds (None: all deployed folds). ``checkpoint_name`` is accepted and unused."""
        folder = Path(model_training_output_dir)
        self.dataset_json = json.loads((folder / "dataset.json").read_text())
        self.plans = json.loads((folder / "plans.json").read_text())
        self._set_folds(use_folds)
        self.client.check_ready()

    def initialize_from_endpoint(self, use_folds: Sequence[int | str] | int | str | None = None) -> None:
        """No local model folder: take labels, channel names and file ending from the server's description."""
        description = describe_endpoint(self.url, self.protocol, endpoint=self.client.model_name)
        published = description.published
        self.dataset_json = {
            "labels": description.labels,
            "file_ending": description.file_ending,
            "channel_names": published.get("channel_names", {}),
        }
        if published.get("regions_class_order"):
            self.dataset_json["regions_class_order"] = published["regions_class_order"]
        self.plans = None
        self._set_folds(use_folds)
        self.client.check_ready()

    def _set_folds(self, use_folds: Sequence[int | str] | int | str | None) -> None:
        if use_folds is None:
            self.use_folds = None
        elif isinstance(use_folds, int | str):
            self.use_folds = (use_folds,)
        else:
            self.use_folds = tuple(use_folds)

    def _require_initialized(self) -> dict[str, Any]:
        if self.dataset_json is None:
            raise InputValidationError(
                "TritonPredictor: call initialize_from_trained_model_folder(...) or "
                "initialize_from_endpoint() first."
            )
        return self.dataset_json

    def _reader_writer(self) -> Any:
        from nnunetv2.imageio.reader_writer_registry import recursive_find_reader_writer_by_name

        name = (self.plans or {}).get("image_reader_writer", "SimpleITKIO")
        return recursive_find_reader_writer_by_name(name)()

    # --- prediction ----------------------------------------------------------------------------------------

    def _segment(self, image: np.ndarray, spacing: Sequence[float], probabilities: bool) -> Any:
        return segment_with_retry(
            self.client,
            image,
            [float(s) for s in spacing],
            retries=self.retries,
            mirroring=self.use_mirroring,
            tile_step_size=self.tile_step_size,
            folds=self.use_folds,
            probabilities=probabilities,
        )

    def _export(
        self, result: Any, properties: dict[str, Any], output_file_truncated: str, save_probabilities: bool
    ) -> None:
        """``export_prediction_from_logits``'s layout: ``<ofile>.npz`` + ``.pkl`` and ``<ofile><ending>``."""
        dataset_json = self._require_initialized()
        if save_probabilities:
            np.savez_compressed(output_file_truncated + ".npz", probabilities=result.probabilities)
            with open(output_file_truncated + ".pkl", "wb") as handle:
                pickle.dump(properties, handle)
        self._reader_writer().write_seg(
            result.segmentation, output_file_truncated + dataset_json["file_ending"], properties
        )

    def predict_single_npy_array(
        self,
        input_image: np.ndarray,
        image_properties: dict,
        segmentation_previous_stage: np.ndarray | None = None,
        output_file_truncated: str | None = None,
        save_or_return_probabilities: bool = False,
    ) -> Any:
        """One case ``(C, z, y, x)`` with ``image_properties['spacing']`` (z, y, x). Returns the segmentation,
        ``(segmentation, probabilities)`` when ``save_or_return_probabilities``, or None when it writes
        ``output_file_truncated`` (which needs ``image_properties['sitk_stuff']`` for SimpleITKIO)."""
        _no_cascade(segmentation_previous_stage)
        result = self._segment(input_image, image_properties["spacing"], save_or_return_probabilities)
        if output_file_truncated is not None:
            self._export(result, image_properties, output_file_truncated, save_or_return_probabilities)
            return None
        if save_or_return_probabilities:
            return result.segmentation, result.probabilities
        return result.segmentation

    def predict_from_list_of_npy_arrays(
        self,
        image_or_list_of_images: np.ndarray | list[np.ndarray],
        segs_from_prev_stage_or_list_of_segs_from_prev_stage: Any,
        properties_or_list_of_properties: dict | list[dict],
        truncated_ofname: str | list[str] | None,
        num_processes: int = 3,
        save_probabilities: bool = False,
        num_processes_segmentation_export: int = DEFAULT_NUM_PROCESSES,
    ) -> list:
        """Like nnU-Net: one entry per image, None for written files, else seg or (seg, probabilities)."""
        _no_cascade(segs_from_prev_stage_or_list_of_segs_from_prev_stage)
        images = (
            image_or_list_of_images
            if isinstance(image_or_list_of_images, list)
            else [image_or_list_of_images]
        )
        props = properties_or_list_of_properties
        props = [props] if isinstance(props, dict) else list(props)
        names = [truncated_ofname] if isinstance(truncated_ofname, str) else truncated_ofname
        names = names if names is not None else [None] * len(images)
        if not len(images) == len(props) == len(names):
            raise InputValidationError(
                f"got {len(images)} images, {len(props)} properties and {len(names)} "
                "output names; they must match."
            )
        return [
            self.predict_single_npy_array(i, p, None, n, save_probabilities)
            for i, p, n in zip(self._progress(images), props, names, strict=False)
        ]

    def predict_from_files(
        self,
        list_of_lists_or_source_folder: str | list[list[str]],
        output_folder_or_list_of_truncated_output_files: str | list[str] | None,
        save_probabilities: bool = False,
        overwrite: bool = True,
        num_processes_preprocessing: int = DEFAULT_NUM_PROCESSES,
        num_processes_segmentation_export: int = DEFAULT_NUM_PROCESSES,
        folder_with_segs_from_prev_stage: str | None = None,
        num_parts: int = 1,
        part_id: int = 0,
    ) -> list | None:
        """nnU-Net's batch prediction: a folder in nnU-Net naming or a list of per-case file lists."""
        _no_cascade(folder_with_segs_from_prev_stage)
        if not 0 <= part_id < num_parts:
            raise InputValidationError(f"part_id must be in [0, num_parts={num_parts}), got {part_id}.")
        dataset_json = self._require_initialized()
        ending = dataset_json["file_ending"]
        cases = list_of_lists_or_source_folder
        if isinstance(cases, str):
            cases = _lists_from_folder(cases, ending)
        cases = cases[part_id::num_parts]
        ids = [os.path.basename(c[0])[: -(len(ending) + 5)] for c in cases]
        outputs = output_folder_or_list_of_truncated_output_files
        if isinstance(outputs, str):
            self._save_run_files(outputs, save_probabilities, overwrite)
            outputs = [os.path.join(outputs, i) for i in ids]
        elif isinstance(outputs, list):
            outputs = outputs[part_id::num_parts]
        if not overwrite and outputs is not None:
            keep = [
                k
                for k, o in enumerate(outputs)
                if not (os.path.isfile(o + ending) and (not save_probabilities or os.path.isfile(o + ".npz")))
            ]
            cases, outputs = [cases[k] for k in keep], [outputs[k] for k in keep]
        if not cases:
            return None
        rw = self._reader_writer()
        results = []
        for k, files in enumerate(self._progress(cases)):
            data, properties = rw.read_images(files)
            ofile = outputs[k] if outputs is not None else None
            results.append(self.predict_single_npy_array(data, properties, None, ofile, save_probabilities))
        return results

    def _save_run_files(self, folder: str, save_probabilities: bool, overwrite: bool) -> None:
        """nnU-Net writes its arguments, dataset.json and plans.json next to the predictions."""
        os.makedirs(folder, exist_ok=True)
        args = {
            "endpoint": f"{self.protocol}://{self.url}",
            "tile_step_size": self.tile_step_size,
            "use_mirroring": self.use_mirroring,
            "use_folds": self.use_folds,
            "save_probabilities": save_probabilities,
            "overwrite": overwrite,
        }
        Path(folder, "predict_from_raw_data_args.json").write_text(json.dumps(args, indent=4))
        Path(folder, "dataset.json").write_text(json.dumps(self.dataset_json, indent=4))
        if self.plans is not None:
            Path(folder, "plans.json").write_text(json.dumps(self.plans, indent=4))

    def _progress(self, items: list) -> Any:
        if not self.allow_tqdm or len(items) < 2:
            return items
        from tqdm import tqdm

        return tqdm(items, desc="TritonPredictor", unit="case")

    def predict_from_data_iterator(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(
            "TritonPredictor: preprocessing runs on the server; use predict_from_files "
            "or predict_from_list_of_npy_arrays."
        )

    def predict_logits_from_preprocessed_data(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(
            "TritonPredictor: the endpoint returns segmentations/probabilities, not "
            "logits of preprocessed data."
        )


def _lists_from_folder(folder: str, file_ending: str) -> list[list[str]]:
    """``create_lists_from_splitted_dataset_folder`` (nnunetv2/utilities/utils.py), without a process pool."""
    files = sorted(
        f for f in os.listdir(folder) if f.endswith(file_ending) and os.path.isfile(os.path.join(folder, f))
    )
    ids = sorted({f[: -(len(file_ending) + 5)] for f in files})
    lists = []
    for case in ids:
        pattern = re.compile(re.escape(case) + r"_\d\d\d\d" + re.escape(file_ending))
        lists.append([os.path.join(folder, f) for f in files if pattern.fullmatch(f)])
    return lists
