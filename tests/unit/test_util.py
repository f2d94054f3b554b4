"""The shared helpers: durable writes, process liveness, file hashing and the retry policy."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time

import pytest

from nnunet_triton.errors import ClientError, ServerUnavailableError
from nnunet_triton.util import durable
from nnunet_triton.util.durable import (
    durable_output,
    remove_stale_temporaries,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from nnunet_triton.util.hashing import sha256_file
from nnunet_triton.util.process import kill, pid_alive, terminate
from nnunet_triton.util.retry import RetryPolicy, TritonCode, is_retryable, is_retryable_error, triton_code


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


# durable writes


def test_write_text_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "config.pbtxt"
    target.write_text("old")
    write_text_atomic(target, "new")
    assert (target.read_text(), [p.name for p in tmp_path.iterdir()]) == ("new", ["config.pbtxt"])


def test_write_json_atomic_writes_json_with_a_final_newline_and_creates_the_folder(tmp_path):
    target = tmp_path / "sub" / "registry.json"
    write_json_atomic(target, {"b": 1, "a": [2]}, sort_keys=True)
    assert target.read_text() == '{"a": [2], "b": 1}\n'


def test_write_json_atomic_keeps_the_old_file_when_the_value_cannot_be_serialised(tmp_path):
    target = tmp_path / "registry.json"
    target.write_text("{}\n")
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json_atomic(target, {"when": object()})
    assert (target.read_text(), [p.name for p in tmp_path.iterdir()]) == ("{}\n", ["registry.json"])


def test_durable_output_keeps_the_target_and_removes_the_temporary_when_writing_fails(tmp_path):
    target = tmp_path / "case.nii.gz"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"), durable_output(target, suffix=".nii.gz") as temp:
        assert temp.parent == tmp_path and temp.name.endswith(".nii.gz") and temp.name.startswith(".")
        temp.write_bytes(b"half")
        raise RuntimeError("disk full")
    assert (target.read_bytes(), [p.name for p in tmp_path.iterdir()]) == (b"old", ["case.nii.gz"])


def test_durable_output_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):  # the real fsync, recording what it was called on
        mode = os.fstat(fd).st_mode
        synced.append(("dir" if stat.S_ISDIR(mode) else "file", (tmp_path / "out.bin").exists()))
        real_fsync(fd)

    monkeypatch.setattr(durable.os, "fsync", recording_fsync)
    write_bytes_atomic(tmp_path / "out.bin", b"data")
    assert synced == [("file", False), ("dir", True)]


def test_remove_stale_temporaries_removes_only_those_of_dead_writers(tmp_path):
    stale = tmp_path / f".a.json.partial-{_dead_pid()}-0a1b2c3d"
    mine = tmp_path / f".b.json.partial-{os.getpid()}-0a1b2c3d"
    other = tmp_path / ".c.json"
    for path in (stale, mine, other):
        path.write_bytes(b"x")
    assert remove_stale_temporaries(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


# process liveness


def test_pid_alive_is_true_for_a_running_process_and_false_for_an_exited_one():
    assert (pid_alive(os.getpid()), pid_alive(_dead_pid())) == (True, False)


def test_pid_alive_is_false_for_a_process_group_id():
    assert (pid_alive(0), pid_alive(-1)) == (False, False)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="zombies are told apart through /proc")
def test_pid_alive_is_false_for_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 60
        while pid_alive(child.pid) and time.monotonic() < deadline:  # exited but not reaped: a zombie
            time.sleep(0.01)
        with open(f"/proc/{child.pid}/stat") as stat_file:
            assert stat_file.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert not pid_alive(child.pid)
    finally:
        child.wait()


# hashing


IGNORES_SIGTERM = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "child = os.fork() if 'group' in sys.argv else 1; "
                   "[time.sleep(0.05) for _ in range(1200)]")


def _reaper(process: subprocess.Popen) -> object:
    return lambda: process.poll() is None


def test_terminate_returns_true_when_the_process_ends_on_the_signal_within_the_grace():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.monotonic()
    assert terminate(process.pid, 30.0, alive=_reaper(process)) is True
    assert process.returncode == -15 and time.monotonic() - started < 30.0


def test_terminate_kills_a_process_that_ignores_the_signal_after_the_grace():
    process = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM])
    time.sleep(1.0)  # its handler is set
    started = time.monotonic()
    assert terminate(process.pid, 0.5, alive=_reaper(process), kill_wait_s=10.0) is False
    assert process.returncode == -9 and 0.5 <= time.monotonic() - started < 10.0


def test_terminate_with_group_kills_the_children_the_process_leaves_behind():
    process = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM, "group"], start_new_session=True)
    time.sleep(1.0)
    children = [int(pid) for pid in
                open(f"/proc/{process.pid}/task/{process.pid}/children").read().split()]
    assert len(children) == 1
    assert terminate(process.pid, 0.3, group=True, alive=_reaper(process), kill_wait_s=10.0) is False
    deadline = time.monotonic() + 10.0
    while pid_alive(children[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(children[0])


def test_terminate_and_kill_of_a_process_already_gone_are_no_error():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert terminate(process.pid, 0.1) is True
    kill(process.pid)
    kill(process.pid, group=True)


def test_sha256_file_equals_the_digest_of_the_whole_content_across_chunks(tmp_path):
    data = os.urandom(3 * (1 << 20) + 7)
    (tmp_path / "model.pt").write_bytes(data)
    assert sha256_file(tmp_path / "model.pt") == hashlib.sha256(data).hexdigest()


# retry


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ("StatusCode.UNAVAILABLE", TritonCode.UNAVAILABLE),
        ("503", TritonCode.UNAVAILABLE),
        ("UNAVAILABLE", TritonCode.UNAVAILABLE),
        ("StatusCode.INVALID_ARGUMENT", TritonCode.INVALID_ARG),
        ("400", TritonCode.INVALID_ARG),
        ("INVALID_ARG", TritonCode.INVALID_ARG),
        ("404", TritonCode.NOT_FOUND),
        ("StatusCode.INTERNAL", TritonCode.INTERNAL),
        ("418", TritonCode.UNKNOWN),
        ("429", TritonCode.UNAVAILABLE),  # the TLS proxy's per-client limits
        (None, None),
    ],
)
def test_triton_code_reads_grpc_http_and_triton_spellings(status, code):
    assert triton_code(status) == code


@pytest.mark.parametrize(
    ("status", "message", "retryable"),
    [
        ("StatusCode.UNAVAILABLE", "model 'nnunet' failed: out of memory", True),
        ("503", "", True),
        ("429", "an exception occurred in the client while decoding the response", True),
        ("400", "input 'IMAGE': expected 4 dims", False),
        ("StatusCode.INTERNAL", "model 'fold_0' failed: division by zero", False),
        ("500", "Stub process 'preprocess_model_0_0' is not healthy.", True),
        ("404", "'nnunet' has no available versions", True),
        ("StatusCode.INVALID_ARGUMENT", "case 'is not ready' is a bad name", False),
        (None, "model 'nnunet' is not ready", False),
    ],
)
def test_retry_decision_is_by_status_code_with_triton_not_running_answers_unavailable(
    status, message, retryable
):
    assert is_retryable(triton_code(status, message)) is retryable
    assert is_retryable_error(ClientError(message, status=status)) is retryable


def test_a_server_unavailable_error_is_retryable_without_a_status():
    assert is_retryable_error(ServerUnavailableError("model 'nnunet' is not ready")) is True
    assert is_retryable_error(RuntimeError("UNAVAILABLE")) is False


def test_retry_policy_doubles_the_delay_up_to_its_maximum():
    policy = RetryPolicy(retries=5, backoff_s=1.0, max_delay_s=3.0)
    assert [policy.delay(n) for n in range(5)] == [1.0, 2.0, 3.0, 3.0, 3.0]


def test_retry_policy_call_retries_retryable_errors_then_returns():
    answers, delays = [ServerUnavailableError("busy"), ClientError("busy", status="503"), "ok"], []

    def flaky():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert RetryPolicy(retries=3, backoff_s=0.5).call(flaky, sleep=delays.append) == "ok"
    assert delays == [0.5, 1.0]


def test_retry_policy_call_raises_a_non_retryable_error_at_once():
    delays = []

    def bad():
        raise ClientError("bad image", status="400")

    with pytest.raises(ClientError, match="bad image"):
        RetryPolicy(retries=3).call(bad, sleep=delays.append)
    assert delays == []


def test_retry_policy_rejects_negative_settings_naming_them():
    with pytest.raises(ValueError, match=r"must be >= 0, got -1, 2.0, inf"):
        RetryPolicy(retries=-1)


