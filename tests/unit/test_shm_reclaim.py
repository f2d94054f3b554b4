"""server.shm_reclaim without a server: the policy from the environment, which stubs count as grown, and
when a grown model counts as idle (its Triton statistics, from a stand-in API object)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nnunet_triton.errors import ServerError
from nnunet_triton.server.health import StubProcess
from nnunet_triton.server.shm_reclaim import (
    ABOVE_ENV,
    IDLE_ENV,
    RELOAD_PARAMETER,
    ReclaimPolicy,
    ShmReclaimer,
)

MiB = 2**20
DEFAULT = 16 * MiB


def test_policy_from_an_empty_environment_is_the_default_and_on():
    policy = ReclaimPolicy.from_env({})
    assert policy == ReclaimPolicy()
    assert policy.enabled and policy.above_bytes == 256 * MiB


def test_policy_reads_mib_and_seconds_and_zero_switches_it_off():
    assert ReclaimPolicy.from_env({ABOVE_ENV: "32", IDLE_ENV: "0.5"}) == ReclaimPolicy(32 * MiB, 0.5)
    assert not ReclaimPolicy.from_env({ABOVE_ENV: "0"}).enabled


@pytest.mark.parametrize("value", ["lots", "-1"])
def test_policy_refuses_a_bad_value_naming_the_variable_and_the_value(value):
    with pytest.raises(ValueError, match=rf"\${ABOVE_ENV} must be a number >= 0, got '{value}'"):
        ReclaimPolicy.from_env({ABOVE_ENV: value})


class _Api:
    """Triton's statistics, config and load calls as the reclaimer makes them (a stand-in: the real calls
    are exercised by tests/triton/test_internal_model_bounds.py)."""

    def __init__(self) -> None:
        self.count = 0
        self.loads: list[tuple[str, dict[str, Any]]] = []
        self.fail_load = False

    def statistics(self, model: str | None = None) -> dict[str, Any]:
        stats = {"success": {"count": self.count}, "fail": {"count": 0}}
        return {"model_stats": [{"inference_count": self.count, "execution_count": self.count,
                                 "inference_stats": stats}]}

    def config(self, model: str) -> dict[str, Any]:
        return {"name": model, "parameters": {"max_voxels": {"string_value": "8"}}}

    def load(self, model: str, config: dict[str, Any] | None = None) -> None:
        if self.fail_load:
            raise ServerError("load of model answered 400: nope")
        self.loads.append((model, config or {}))


def _stub(tmp_path: Path, pid: int, model: str, size: int) -> StubProcess:
    region = f"triton_python_backend_shm_region_{pid}"
    with open(tmp_path / region, "wb") as f:
        f.truncate(size)
    return StubProcess(pid=pid, parent_pid=1, model=model, instance=f"{model}_0_0", shm_region=region,
                       shm_default_bytes=DEFAULT)


def test_only_regions_grown_beyond_the_threshold_count(tmp_path):
    reclaimer = ShmReclaimer(_Api(), ReclaimPolicy(32 * MiB, 0.0), shm=tmp_path,
                             proc=tmp_path / "proc")  # type: ignore[arg-type]
    stubs = [_stub(tmp_path, 10, "preprocess_model", DEFAULT + 32 * MiB),  # at the threshold: kept
             _stub(tmp_path, 11, "stitch_model", DEFAULT + 64 * MiB)]
    assert reclaimer.grown(stubs) == {"stitch_model": {"stitch_model_0_0": DEFAULT + 64 * MiB}}


def test_a_grown_idle_model_is_loaded_again_with_a_changed_parameter_and_its_old_stub_is_not_counted_again(
        tmp_path):
    api = _Api()
    reclaimer = ShmReclaimer(api, ReclaimPolicy(32 * MiB, 0.0), shm=tmp_path,
                             proc=tmp_path / "proc")  # type: ignore[arg-type]
    stubs = [_stub(tmp_path, 11, "stitch_model", DEFAULT + 64 * MiB)]
    (reclaim,) = reclaimer.check(stubs)
    assert reclaim.ok and reclaim.model == "stitch_model" and reclaim.default_bytes == DEFAULT
    assert reclaim.to_event()["event"] == "shm_reclaim"
    ((model, config),) = api.loads
    assert config["parameters"][RELOAD_PARAMETER] == {"string_value": "1"}
    assert config["parameters"]["max_voxels"] == {"string_value": "8"}  # the rest as served
    assert reclaimer.check(stubs) == []  # the old stub finishes its requests: not reloaded twice


def test_a_busy_model_waits_for_the_idle_time(tmp_path):
    api = _Api()
    reclaimer = ShmReclaimer(api, ReclaimPolicy(32 * MiB, 3600.0), shm=tmp_path,
                             proc=tmp_path / "proc")  # type: ignore[arg-type]
    stubs = [_stub(tmp_path, 11, "stitch_model", DEFAULT + 64 * MiB)]
    assert reclaimer.check(stubs) == []
    api.count += 1
    assert reclaimer.check(stubs) == [] and api.loads == []


def test_a_failed_load_is_reported_and_retried_later(tmp_path):
    api = _Api()
    api.fail_load = True
    reclaimer = ShmReclaimer(api, ReclaimPolicy(32 * MiB, 0.0), shm=tmp_path,
                             proc=tmp_path / "proc")  # type: ignore[arg-type]
    stubs = [_stub(tmp_path, 11, "stitch_model", DEFAULT + 64 * MiB)]
    (reclaim,) = reclaimer.check(stubs)
    assert not reclaim.ok and "nope" in str(reclaim.error)
    assert reclaimer.check(stubs) == []  # backoff: 1 s before the next try


def _cpu(proc: Path, pid: int, ticks: int) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    fields = ["S", "1", *["0"] * 9, str(ticks), "0"]  # state, ppid, ..., utime (field 14), stime (15)
    (proc / str(pid) / "stat").write_text(f"{pid} (triton_python_b) {' '.join(fields)}\n")


def test_a_model_whose_stub_burns_cpu_is_busy_although_no_count_moved(tmp_path, monkeypatch):
    """A long single step (resampling a large image) moves no Triton count until it is done."""
    clock = [1000.0]
    monkeypatch.setattr("nnunet_triton.server.shm_reclaim.time.monotonic", lambda: clock[0])
    api = _Api()
    reclaimer = ShmReclaimer(api, ReclaimPolicy(32 * MiB, 10.0), shm=tmp_path,  # type: ignore[arg-type]
                             proc=tmp_path / "proc")
    stubs = [_stub(tmp_path, 11, "preprocess_model", DEFAULT + 64 * MiB)]
    _cpu(tmp_path / "proc", 11, 0)
    assert reclaimer.check(stubs) == []
    for second in range(1, 21):  # 20 s without a count moving, the stub at 100 % of a core
        clock[0] += 1.0
        _cpu(tmp_path / "proc", 11, second * 100)
        assert reclaimer.check(stubs) == [], second
    done = []
    for _ in range(10):  # the step is done: quiet from now on, reloaded once quiet for 10 s
        clock[0] += 1.0
        assert not done
        done = reclaimer.check(stubs)
    assert [r.model for r in done] == ["preprocess_model"] and len(api.loads) == 1


def test_a_bad_setting_stops_the_container_entry_point_and_the_watchdog_with_its_name(tmp_path, monkeypatch,
                                                                                      caplog):
    """Not a watchdog that dies unseen after the fork (containers) or with a traceback (embedded)."""
    from nnunet_triton.server import watchdog
    from nnunet_triton.server.server_config import from_args

    library = tmp_path / "preload.so"  # present: the preload check (before this one) passes
    library.write_bytes(b"\x7fELF")
    monkeypatch.setenv(ABOVE_ENV, "lots")
    with pytest.raises(ValueError, match=rf"\${ABOVE_ENV} must be a number >= 0, got 'lots'"):
        server = from_args(["tritonserver", "--http-port=8000", f"--model-repository={tmp_path}"])
        watchdog.fork_for_exec(server, tmp_path, preload=library)
    monkeypatch.setenv(watchdog.TOKEN_ENV, "token")
    argv = ["--url", "127.0.0.1:1", "--server-pid", "1", "--model-repository", str(tmp_path)]
    assert watchdog.main(argv) == 2
    assert f"${ABOVE_ENV} must be a number" in caplog.text
