"""Run an exported fold network (TorchScript ``model.pt``) on a list of tile batches.

Used by the Python-backend fold runner's serving step (``serving.steps.fold_runner``), which hands it
the tiles of every request in one dynamic batch; kept here so it is testable without Triton.

Numerics on CPU: a traced network reproduces the eager nnU-Net network bit for bit at equal batch
size. Across batch sizes it may not: PyTorch sends a convolution to oneDNN or to its native kernel
depending on the input's size (batch included), and the two round differently (measured ~6e-6 max
abs on fp32 logits of the tiny test network). nnU-Net's predictor runs one tile per forward, so
``max_forward_batch=1`` is the setting that reproduces it exactly; ``0`` (one forward per dynamic
batch) is the fast default. oneDNN's batched convolutions also round differently with another
thread count (~5e-7 measured), so bit-identical parity with an nnU-Net process also needs the same
``torch.get_num_threads()``. ``num_threads`` is set as given (0 leaves torch's setting); the Python
runner's step (``serving.steps.fold_runner``) passes what the launcher's thread budget says
(``nnunet_triton.pipeline.threads.fold_threads_for_runner``: one share of the available CPUs per fold
instance, or without a launcher torch's default capped at the CPUs really available).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.errors import InputValidationError

__all__ = ["TorchScriptRunner", "load_runner"]

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchScriptRunner:
    """A loaded TorchScript fold network plus how to call it.

    Attributes:
        module: the ``torch.jit.ScriptModule`` in eval mode.
        device: ``torch.device`` the module and its inputs live on.
        sample_shape: expected per-sample input shape ``(C_in, *patch)``; ``None`` skips the check.
        max_forward_batch: most samples per forward (0 = everything in one forward).
        output_dtype: ``torch.dtype`` outputs are cast to (the config's OUTPUT__0 type), or ``None``.
    """

    module: Any
    device: Any
    sample_shape: tuple[int, ...] | None = None
    max_forward_batch: int = 0
    output_dtype: Any = None

    def _check(self, index: int, batch: Any) -> None:
        if self.sample_shape is not None and tuple(batch.shape[1:]) != self.sample_shape:
            raise InputValidationError(
                f"request {index}: input must have shape [N, {', '.join(map(str, self.sample_shape))}], "
                f"got {list(batch.shape)}."
            )

    def forward(self, x: Any) -> Any:
        """Run the module on one batch ``x`` (N, C_in, *patch), in chunks of ``max_forward_batch``."""
        import torch

        chunk = self.max_forward_batch or x.shape[0]
        with torch.inference_mode():
            parts = [self.module(x[i:i + chunk]) for i in range(0, x.shape[0], chunk)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            return out.to(self.output_dtype) if self.output_dtype is not None else out

    def run(self, batches: Sequence[Any]) -> list[Any]:
        """Concatenate the requests' batches, run them, and split the result back per request.

        Args:
            batches: one torch tensor (N_i, C_in, *patch) per request, any device.

        Returns:
            One tensor (N_i, K, *patch) per request, on ``device``.

        Raises:
            InputValidationError: a batch has the wrong per-sample shape.
        """
        import torch

        for index, batch in enumerate(batches):
            self._check(index, batch)
        sizes = [int(b.shape[0]) for b in batches]
        x = torch.cat([b.to(self.device, torch.float32) for b in batches]) if len(batches) > 1 else (
            batches[0].to(self.device, torch.float32))
        out = self.forward(x)
        return list(torch.split(out, sizes))


def load_runner(
    path: str | Path,
    *,
    device: str = "cpu",
    num_threads: int = 0,
    sample_shape: Sequence[int] | None = None,
    max_forward_batch: int = 0,
    output_dtype: str | None = None,
) -> TorchScriptRunner:
    """Load ``path`` with ``torch.jit.load`` and return a runner.

    Args:
        num_threads: ``torch.set_num_threads`` for this process (one Triton stub per instance);
            0 leaves torch's own setting.
        output_dtype: ``"float32"``/``"float16"`` or ``None`` (keep what the module returns).
    """
    import torch

    if num_threads < 0 or max_forward_batch < 0:
        raise ValueError(
            f"num_threads and max_forward_batch must be >= 0, got {num_threads} and {max_forward_batch}."
        )
    if num_threads:
        torch.set_num_threads(num_threads)
    if str(device).startswith("cuda"):
        torch.backends.cudnn.benchmark = True  # as nnUNetPredictor: the tile shape never changes
    with warnings.catch_warnings():  # newer torch warns that TorchScript is deprecated
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.", category=FutureWarning)
        module = torch.jit.load(str(path), map_location=device)
    module.eval()
    LOGGER.info("loaded %s on %s (%d torch threads)", path, device, torch.get_num_threads())
    return TorchScriptRunner(
        module=module,
        device=torch.device(device),
        sample_shape=tuple(int(s) for s in sample_shape) if sample_shape is not None else None,
        max_forward_batch=max_forward_batch,
        output_dtype=getattr(torch, output_dtype) if output_dtype else None,
    )
