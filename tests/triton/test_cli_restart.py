"""A server crash in the middle of an ``nnunet-triton predict`` batch loses no outputs: the CLI resumes.

The CLI segments a folder of the SynthCT held-out cases (fold 0, no mirroring) against its own embedded
server. As soon as the first output exists the whole server (tritonserver and its Python stubs) is
killed with SIGKILL, a crash, not a drain. The CLI must report the cases it could not finish and exit 1
without leaving a partial file. A new server on the same repository (new ports) then gets the same
command with ``--continue-prediction``: it writes only the missing cases, leaves the earlier outputs
untouched (same inode and mtime), and every output equals nnU-Net's segmentation of that case.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import SimpleITK as sitk
from pipeline_support import REPO_ROOT, SYNTHCT, build, cases, model_dir, reference

CLI_TIMEOUT_S = 600
FOLDS = (0,)


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }


def _command(url: str, source: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nnunet_triton.cli", "predict", "--url", url, "-i", str(source),
            "-o", str(out), "--disable-tta", "-f", *map(str, FOLDS), *extra]


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _mapped_shm(pids: list[int]) -> set[Path]:
    """The /dev/shm files the processes map (the Python backend's regions, which a SIGKILL leaks)."""
    found = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for fields in (line.split(maxsplit=5) for line in lines):
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                found.add(Path(fields[5]))
    return found


def _crash(server) -> None:
    """SIGKILL tritonserver and its stubs (one process group), then remove the shm regions they leave."""
    shm = _mapped_shm(_group_pids(server.pid))
    os.killpg(server.pid, signal.SIGKILL)
    server.stop()  # reaps the process and the group
    for path in shm:
        path.unlink(missing_ok=True)


def _wait_for_output(out: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while not any(out.glob("*.nii.gz")):
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no output appeared (CLI exit code {process.poll()})")
        time.sleep(0.02)


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


def test_predict_resumes_after_server_crash_without_losing_or_rewriting_outputs(triton_server, tmp_path,
                                                                                record_property):
    repository = build(SYNTHCT)
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    names = [case.name for case in cases(SYNTHCT)]
    for name in names:
        shutil.copy(model_dir(SYNTHCT).parent / "imagesTs" / f"{name}_0000.nii.gz", source)

    with triton_server(repository) as first:
        process = subprocess.Popen(_command(first.http_url, source, out), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=_env())
        try:
            _wait_for_output(out, process)
            _crash(first)
            _, stderr = process.communicate(timeout=CLI_TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    survived = {path.name: _stamp(path) for path in out.iterdir()}
    record_property("outputs_before_crash", len(survived))
    assert process.returncode == 2, stderr  # failed cases: exit 2 (nnunet_triton.exit_codes)
    assert 1 <= len(survived) < len(names), (survived, stderr)  # the crash hit the batch in the middle
    assert f"{len(names) - len(survived)} failed." in stderr, stderr
    assert set(survived) <= {f"{name}.nii.gz" for name in names}  # no partial/temporary file

    with triton_server(repository) as second:
        again = subprocess.run(_command(second.http_url, source, out, "--continue-prediction"),
                               capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=_env(), check=False)
    assert again.returncode == 0, again.stderr
    assert (f"{len(names) - len(survived)} case(s) written to {out}, {len(survived)} skipped (done before), "
            "0 failed.") in again.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{name}.nii.gz" for name in names)
    assert {name: _stamp(out / name) for name in survived} == survived
    for name in names:
        written = sitk.GetArrayFromImage(sitk.ReadImage(str(out / f"{name}.nii.gz")))
        np.testing.assert_array_equal(written, reference(SYNTHCT, name, False, FOLDS).segmentation)
