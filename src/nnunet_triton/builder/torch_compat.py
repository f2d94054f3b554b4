"""Which torch loads the exported fold models where they are served, and the build-time refusal.

A TorchScript ``model.pt`` saved by a newer torch may not load in an older libtorch (pytorch/pytorch#62313:
a newer export fails in an older Triton with "Unknown type name 'NoneType'"). Triton's ``pytorch_libtorch``
backend loads the fold models with the libtorch its NGC release was built from (the GPU image's release,
``GPU_TRITON_RELEASE`` 26.09: PyTorch 2.14; 24.10: PyTorch 2.5), so the builder refuses to export for that
runner with a newer torch, before any work, naming both versions and the two ways out (export in the
matching container: ``nnunet-triton deploy --target docker``; or say which libtorch the server really has:
``--serving-torch``). ``repository_metadata.json`` records both versions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nnunet_triton.errors import ConfigParameterError, ExportError

__all__ = [
    "DEFAULT_TRITON_RELEASE",
    "GPU_TRITON_RELEASE",
    "TRITON_RELEASES",
    "TritonRelease",
    "DEFAULT_LIBTORCH",
    "torch_minor",
    "torch_minor_text",
    "export_fits",
    "check_export_torch",
]

DEFAULT_TRITON_RELEASE = "24.10"  # Triton 2.51.0, the release of the embedded (PyTriton 0.7.0) server
# the GPU image's NGC release (docker/Dockerfile): every Triton CVE published through 2026-09 is fixed in
# 26.07 and later (server/cves.json; 25.12 still had both 2026 9.8s), 24.10's CUDA 12.6 and torch 2.5 have no
# Blackwell kernels; 26.09 (Triton 2.73.0) is the newest release whose libtorch (2.14) could be confirmed
# here, and pip has that torch for the export (docs/deploy.md "The GPU image on NGC 26.09")
GPU_TRITON_RELEASE = "26.09"


@dataclass(frozen=True)
class TritonRelease:
    """One NGC ``tritonserver:<release>-py3`` image (versions from its build.py / NGC release notes)."""

    release: str
    triton_version: str
    libtorch: str  # torch major.minor the pytorch_libtorch backend is built from
    python: str  # the Python-backend stub's Python


# 24.10: checked against its sources (r24.10 trees). 25.12: from NGC's release notes as recalled, not
# checked offline (carries the CVEs of 2026: kept only for --triton-release 25.12). 26.07 and 26.09: Triton
# version from the GitHub release titles (v2.71.0 "corresponding to NGC container 26.07", v2.73.0 ... 26.09);
# libtorch from the torch of NGC's pytorch:26.07-py3 / 26.09-py3 (2.13.0a0 / 2.14.0a0, as reported by
# third-party `docker image inspect` and torch.__version__ records; NVIDIA's PyTorch release-note pages of
# 26.xx were not readable here); Python 3.12 likewise (docs/deploy.md). The GPU image's build checks the
# libtorch and Python it really has (docker/Dockerfile). Other releases need an explicit libtorch version.
TRITON_RELEASES = {
    "24.10": TritonRelease("24.10", "2.51.0", libtorch="2.5", python="3.10"),
    "25.12": TritonRelease("25.12", "2.64.0", libtorch="2.10", python="3.12"),
    "26.07": TritonRelease("26.07", "2.71.0", libtorch="2.13", python="3.12"),
    "26.09": TritonRelease("26.09", "2.73.0", libtorch="2.14", python="3.12"),
}
DEFAULT_LIBTORCH = TRITON_RELEASES[GPU_TRITON_RELEASE].libtorch  # loads libtorch fold models by default


def torch_minor(version: str) -> tuple[int, int]:
    """``"2.5.0a0+e000cf0ad9.nv24.10"`` -> ``(2, 5)``."""
    match = re.match(r"^\s*(\d+)\.(\d+)", str(version))
    if match is None:
        raise ConfigParameterError(f"torch version {version!r} is not of the form MAJOR.MINOR[...].")
    return int(match.group(1)), int(match.group(2))


def torch_minor_text(version: str) -> str:
    major, minor = torch_minor(version)
    return f"{major}.{minor}"


def export_fits(export_torch: str, serving_torch: str | None) -> bool:
    """True when a file exported with ``export_torch`` loads in ``serving_torch`` (None: the same torch):
    the exporting major.minor is not newer."""
    return serving_torch is None or torch_minor(export_torch) <= torch_minor(serving_torch)


def check_export_torch(export_torch: str, serving_torch: str | None, *, runner: str) -> None:
    """Refuse to export fold models with ``export_torch`` when the server loads them with an older torch.

    Args:
        export_torch: this environment's ``torch.__version__``.
        serving_torch: major.minor of the torch that loads the files where they are served (the fold runner's
            libtorch, or the Python runner's pip torch); ``None``: the serving environment's own torch (the
            embedded server runs the build environment's torch), nothing to check.
        runner: the fold runner, for the message.

    Raises:
        ExportError: ``export_torch`` is newer (major.minor) than ``serving_torch``.
    """
    if export_fits(export_torch, serving_torch):
        return
    loading = torch_minor_text(serving_torch)
    raise ExportError(
        f"the {runner} fold runner loads the fold models with torch {loading} (libtorch of "
        f"nvcr.io/nvidia/tritonserver:{GPU_TRITON_RELEASE}-pyt-python-py3 is {DEFAULT_LIBTORCH}) but this "
        f"environment exports with torch {export_torch}, which is newer: a TorchScript file from a "
        "newer torch may not load in an older one. Export with a matching torch: `nnunet-triton deploy "
        "--target docker --execute` (a checkout: `make deploy TARGET=docker`) builds the repository "
        f"in a container with torch {DEFAULT_LIBTORCH}.x; or pass --serving-torch X.Y if the server's "
        "libtorch is X.Y."
    )
