"""Whether a fold thread count gives nnU-Net's bits on this machine, found by running the networks.

oneDNN picks its convolution kernels by CPU, thread count and shape, and kernels round differently: on
an AMD EPYC (AVX2) the committed fixtures' networks give identical logits with 1 and 2 threads, on an
Intel Xeon with AVX-512 and AMX they differ by up to 1.3e-5. So no rule written in advance says which
thread counts are exact; this module measures it where the server runs.

* **nnU-Net's count** (:func:`nnunet_threads`): ``nnUNetPredictor.predict_logits_from_preprocessed_data``
  runs every forward with ``torch.set_num_threads(min(default_num_processes, torch.get_num_threads()))``,
  ``default_num_processes`` being ``$nnUNet_def_n_proc`` or 8 (``nnunetv2/configuration.py``).
* **The check**: a child process started like a fold model's stub (same Python, same environment,
  ``pipeline.fold_runner.load_runner`` with the thread count, the model's ``per_sample_forward``) runs
  one seeded N(0, 1) tile (nnU-Net's normalized intensities) through every fold network of the
  repository, once at nnU-Net's count (:func:`reference_run`, which also tells the count) and once at
  the candidate count (:func:`check_threads`); the candidate is exact when every output is bitwise
  equal. One tile is evidence, not proof for every input: the
  kernels are chosen by shape and thread count, not by value, and a kernel change shows on a random tile
  (33-43 % of the logits differed on the AVX-512 machine).
* **Cache**: results are kept under ``$NNUNET_TRITON_CACHE_DIR`` (default ``~/.cache/nnunet_triton``),
  keyed by everything the kernels depend on: the CPU (model name and flags), the Python and torch
  builds, the numerics-relevant environment, the networks' sha256 and shapes and the thread counts.
  An unwritable cache only costs the check again.

Child command (what :func:`reference_run` and :func:`check_threads` run)::

    python -m nnunet_triton.server.exactness run --spec SPEC.json --threads N|nnunet --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.options import parse_int
from nnunet_triton.pipeline.threads import NNUNET_PROCESSES_ENV, nnunet_threads
from nnunet_triton.util.durable import write_json_atomic
from nnunet_triton.util.hashing import sha256_file

__all__ = [
    "CACHE_ENV",
    "FoldNetwork",
    "ThreadCheck",
    "cpu_identity",
    "Reference",
    "reference_run",
    "check_threads",
    "main",
]

LOGGER = logging.getLogger(__name__)

CACHE_ENV = "NNUNET_TRITON_CACHE_DIR"
TILE_SEED = 20261202
CHILD_TIMEOUT_S = 900.0
# Everything in the environment that can change which kernels run or how many threads they get.
_NUMERICS_ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "DNNL_", "ONEDNN_", "ATEN_", "TORCH_")
_NUMERICS_ENV = (NNUNET_PROCESSES_ENV, "OPENBLAS_NUM_THREADS", "LD_PRELOAD")


def cpu_identity(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """The CPU as the kernels see it: ``{"model": ..., "flags": ..., "simd": ...}`` (first processor).

    ``simd`` lists the vector-extension flags (sse*, avx*, amx*, fma, f16c, neon/asimd/sve on Arm) that
    decide oneDNN's kernels; ``flags`` is the whole list, which the cache key uses.
    """
    model, flags = "unknown CPU", ""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and model == "unknown CPU":
            model = value.strip() or model
        elif key in ("flags", "features") and not flags:
            flags = " ".join(value.split())
    simd = [f for f in flags.split() if f.startswith(("sse", "ssse", "avx", "amx", "asimd", "sve"))
            or f in ("fma", "f16c", "neon")]
    return {"model": model, "flags": flags, "simd": " ".join(simd)}


@dataclass(frozen=True)
class FoldNetwork:
    """One Python fold-runner model as the stub runs it."""

    model: str  # Triton model name, e.g. fold_0
    path: str  # its TorchScript file
    sample_shape: tuple[int, ...]  # (C, *patch): one tile
    per_sample_forward: bool
    configured_threads: int = 0  # the model's torch_num_threads (0: the launcher's budget)


@dataclass(frozen=True)
class ThreadCheck:
    """What running the networks at two thread counts showed."""

    candidate: int
    reference: int  # nnU-Net's count
    identical: bool
    networks: tuple[str, ...]
    first_difference: str  # "" when identical, else "<model>: <n> of <m> values differ, max |diff| <d>"
    seconds: float
    cached: bool = False

    def summary(self) -> str:
        where = ", ".join(self.networks)
        if self.identical:
            return (f"{self.candidate} thread(s) bitwise equal to nnU-Net's {self.reference} on one tile of "
                    f"{where}" + (" (cached)" if self.cached else f" ({self.seconds:.1f} s)"))
        return (f"{self.candidate} thread(s) NOT bitwise equal to nnU-Net's {self.reference}: "
                f"{self.first_difference}" + (" (cached)" if self.cached else f" ({self.seconds:.1f} s)"))


def _cache_dir(env: Mapping[str, str]) -> Path:
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nnunet_triton"


def _numerics_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items())
            if k.startswith(_NUMERICS_ENV_PREFIXES) or k in _NUMERICS_ENV}


def _torch_build() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "absent"


def _key(kind: str, payload: Mapping[str, object], env: Mapping[str, str]) -> str:
    base = {"kind": kind, "cpu": cpu_identity(), "python": sys.executable, "torch": _torch_build(),
            "affinity": sorted(os.sched_getaffinity(0)), "env": _numerics_env(env), **payload}
    return hashlib.sha256(json.dumps(base, sort_keys=True, default=str).encode()).hexdigest()


def _cached(key: str, env: Mapping[str, str]) -> dict | None:
    try:
        return json.loads((_cache_dir(env) / "thread-check" / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def _store(key: str, value: Mapping[str, object], env: Mapping[str, str]) -> None:
    folder = _cache_dir(env) / "thread-check"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder / f"{key}.json", value, sort_keys=True)
    except OSError as exc:
        LOGGER.info("thread check: cache %s not writable (%s); the check runs again next time", folder, exc)


def _run_child(spec: Path, threads: str, out: Path, env: Mapping[str, str]) -> dict:
    command = [sys.executable, "-m", "nnunet_triton.server.exactness", "run", "--spec", str(spec),
               "--threads", threads, "--out", str(out)]
    child_env = dict(env)
    child_env.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                              env=child_env, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the run at {threads} thread(s) took over {CHILD_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"the run at {threads} thread(s) failed (exit {done.returncode}): "
                           + " | ".join(tail))
    return json.loads((out / "result.json").read_text())


@dataclass(frozen=True)
class Reference:
    """The networks run at nnU-Net's count in a fresh process: the count and each output's sha256."""

    torch_default: int
    threads: int
    digests: dict[str, str]
    networks: tuple[FoldNetwork, ...]
    fingerprint: tuple[dict, ...]  # the networks as the cache keys see them (sha256 of each file)
    cached: bool = False


def _fingerprint(networks: Sequence[FoldNetwork]) -> tuple[dict, ...]:
    """What a run's outputs depend on (not where the file lies, not its model's own thread setting)."""
    return tuple({"model": n.model, "sample_shape": list(n.sample_shape), "per_sample": n.per_sample_forward,
                  "sha256": sha256_file(n.path)} for n in networks)


def _in_child(networks: Sequence[FoldNetwork], threads: str, out: Path, env: Mapping[str, str]) -> dict:
    spec = out / "spec.json"
    spec.write_text(json.dumps([asdict(n) for n in networks]))
    return _run_child(spec, threads, out, env)


def reference_run(networks: Sequence[FoldNetwork], *, env: Mapping[str, str] | None = None) -> Reference:
    """Run one tile of every network at nnU-Net's count, as ``nnUNetPredictor`` sets it; cached.

    Raises:
        RuntimeError: the child failed (no torch here, a network that does not load or run).
    """
    env = dict(os.environ if env is None else env)
    networks = tuple(sorted(networks, key=lambda n: n.model))
    fingerprint = _fingerprint(networks)
    key = _key("reference", {"networks": fingerprint}, env)
    hit = _cached(key, env)
    cached = hit is not None
    if hit is None:
        with tempfile.TemporaryDirectory(prefix="nnunet-thread-reference-") as tmp:
            hit = _in_child(networks, "nnunet", Path(tmp), env)
        _store(key, hit, env)
    return Reference(int(hit["torch_default"]), int(hit["threads"]), dict(hit["digests"]), networks,
                     fingerprint, cached=cached)


def _difference(reference: Path, candidate: Path, networks: Sequence[FoldNetwork]) -> str:
    import numpy as np

    for network in networks:
        want = np.load(reference / f"{network.model}.npy")
        got = np.load(candidate / f"{network.model}.npy")
        if want.shape != got.shape:
            return f"{network.model}: output shape {got.shape} vs {want.shape}"
        if want.tobytes() != got.tobytes():
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            return (f"{network.model}: {int(np.count_nonzero(got != want))} of {want.size} values differ, "
                    f"max |diff| {float(np.nanmax(diff)):.3g}")
    return ""


def check_threads(reference: Reference, candidate: int, *, networks: Sequence[FoldNetwork] | None = None,
                  env: Mapping[str, str] | None = None) -> ThreadCheck:
    """Run one tile of ``networks`` (default: all of ``reference``'s) at ``candidate`` threads and
    compare every output bitwise with ``reference``'s; the verdict is cached.

    Raises:
        RuntimeError: the child failed; the caller then treats the candidate as unproven.
    """
    env = dict(os.environ if env is None else env)
    chosen = {n.model for n in (networks if networks is not None else reference.networks)}
    subset = tuple(n for n in reference.networks if n.model in chosen)
    prints = tuple(f for n, f in zip(reference.networks, reference.fingerprint, strict=True)
                   if n.model in chosen)
    key = _key("check", {"threads": candidate, "reference": reference.threads, "networks": prints}, env)
    names = tuple(n.model for n in subset)
    hit = _cached(key, env)
    if hit is not None:
        return ThreadCheck(candidate, reference.threads, bool(hit["identical"]), names,
                           str(hit["first_difference"]), float(hit["seconds"]), cached=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nnunet-thread-check-") as tmp:
        root = Path(tmp)
        (root / "candidate").mkdir()
        digests = _in_child(subset, str(candidate), root / "candidate", env)["digests"]
        difference = ""
        if any(digests[n] != reference.digests[n] for n in names):
            (root / "reference").mkdir()  # again, for the arrays: the cache holds only their digests
            _in_child(subset, "nnunet", root / "reference", env)
            difference = _difference(root / "reference", root / "candidate", subset) or (
                "outputs differ from the cached reference run's")
    check = ThreadCheck(candidate, reference.threads, not difference, names, difference,
                        time.monotonic() - started)
    _store(key, {"identical": check.identical, "first_difference": check.first_difference,
                 "seconds": check.seconds}, env)
    return check


def _run(spec: Path, threads: str, out: Path) -> int:
    """The child: set the thread count as the stub would, run one tile per network, save the outputs."""
    import numpy as np
    import torch

    from nnunet_triton.pipeline.fold_runner import load_runner

    default, digests = torch.get_num_threads(), {}
    count = nnunet_threads(default) if threads == "nnunet" else parse_int(
        "--threads", threads, minimum=1, label="--threads", error=ValueError)
    for item in json.loads(spec.read_text()):
        network = FoldNetwork(**{**item, "sample_shape": tuple(item["sample_shape"])})
        runner = load_runner(network.path, num_threads=count, sample_shape=network.sample_shape,
                             max_forward_batch=1 if network.per_sample_forward else 0)
        tile = np.random.default_rng(TILE_SEED).standard_normal((1, *network.sample_shape), dtype=np.float32)
        output = runner.forward(torch.from_numpy(tile)).float().numpy()
        np.save(out / f"{network.model}.npy", output)
        digests[network.model] = hashlib.sha256(output.tobytes()).hexdigest()
    (out / "result.json").write_text(json.dumps({"torch_default": default, "threads": count,
                                                 "digests": digests}))
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnunet_triton.server.exactness",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="(the check's child) run one tile per network at a thread count")
    run.add_argument("--spec", type=Path, required=True, help="JSON list of networks")
    run.add_argument("--threads", required=True, help="a thread count, or 'nnunet' for nnU-Net's")
    run.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return _run(args.spec, args.threads, args.out)


if __name__ == "__main__":
    sys.exit(main())
