"""TorchScript stand-ins for fold networks, for the thread-budget check (``server.exactness``).

``ThreadDependent``'s output depends on the thread count the way oneDNN's kernels do on some CPUs: its
first 16 values are 16 parallel float32 sums of ~1.5 M terms (64 copies of a tile of >= 24,576 values,
each sum with its own scale), whose partial sums are split by thread. One such sum at 1 and at 2 threads
is bitwise equal about a third of the time (measured on 60 random tiles), all 16 at once about never
(0 of 60; ~0.34^16). ``Elementwise`` computes the same bits with any thread count.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

__all__ = ["Elementwise", "ThreadDependent", "save"]


class ThreadDependent(torch.nn.Module):
    def __init__(self, out_channels: int) -> None:
        super().__init__()
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        terms = x.reshape(-1).repeat(64)
        sums = torch.stack([(terms * (1.0 + 0.01 * k)).sum() for k in range(16)])
        out = torch.zeros_like(x[:, :1]).repeat(1, self.out_channels, 1, 1, 1)
        out.reshape(-1)[:16] = sums
        return out


class Elementwise(torch.nn.Module):
    def __init__(self, out_channels: int) -> None:
        super().__init__()
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :1].repeat(1, self.out_channels, 1, 1, 1) * 2.0 + 1.0


def save(module: torch.nn.Module, path: Path) -> Path:
    """Script ``module`` and write it to ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.script(module).save(str(path))
    return path
