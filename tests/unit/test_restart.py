"""server.restart: backoff between restarts of a dead tritonserver, the crash-loop limit, the launch spec."""

from __future__ import annotations

import json
import time

import pytest

from nnunet_triton.server import proxy_keeper, watchdog
from nnunet_triton.server.restart import LaunchSpec, RestartPolicy
from nnunet_triton.server.server_config import TritonServerConfig
from nnunet_triton.server.watchdog import Watchdog


def test_consecutive_restarts_wait_0_1_2_4_then_30_s_at_most():
    policy = RestartPolicy(max_restarts=10, window_s=600.0)
    assert [policy.next_delay(float(t)) for t in range(8)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_failed_reloads_and_proxy_restarts_back_off_through_the_retry_policy():
    assert [watchdog.RELOAD_BACKOFF.delay(n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert [proxy_keeper.RESTART_BACKOFF.delay(n) for n in range(6)] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0]


def test_sixth_restart_within_ten_minutes_is_refused_as_a_crash_loop():
    policy = RestartPolicy()
    assert [policy.next_delay(t * 60.0) for t in range(5)] == [0.0, 1.0, 2.0, 4.0, 8.0]
    assert policy.next_delay(5 * 60.0) is None
    assert "5 restarts within 600 s: a crash loop" in policy.describe_give_up()


def test_restarts_older_than_the_window_no_longer_count():
    policy = RestartPolicy()
    for t in range(5):
        policy.next_delay(float(t))
    assert policy.next_delay(700.0) == 0.0  # all five are more than 600 s old


def test_bad_policy_settings_are_refused_naming_the_values():
    with pytest.raises(ValueError, match="max_restarts must be >= 1.*got 0"):
        RestartPolicy(max_restarts=0)


def test_launch_spec_keeps_only_the_environment_the_server_had_on_top_of_the_watchdogs_and_no_secret(
        tmp_path):
    spec = LaunchSpec.for_server(TritonServerConfig(("/models",), 1, 2, 3, 15),
                                 {"A": "1", "B": "2", "TOKEN": "t"},
                                 {"A": "1", "TOKEN": "t"}, log_file=tmp_path / "log", pid_file=None,
                                 state_file=tmp_path / "server.json", secret_keys=("TOKEN",))
    spec.write(tmp_path / "launch.json")
    assert (tmp_path / "launch.json").stat().st_mode & 0o077 == 0
    assert LaunchSpec.read(tmp_path / "launch.json") == spec
    assert json.loads((tmp_path / "launch.json").read_text())["environment"] == {"B": "2"}


def test_watchdog_gives_up_after_a_crash_loop_and_records_why(tmp_path):
    spec = LaunchSpec(TritonServerConfig(("/models",), 1, 2, 3, 15, server_bin="false"), {},
                      str(tmp_path / "log"), None, None)
    events = tmp_path / "events.jsonl"
    watchdog = Watchdog("127.0.0.1:1", 2**22 + 1, [], "token", events_file=events, launch=spec,
                        policy=RestartPolicy(max_restarts=1))
    watchdog.policy.restarts = [time.monotonic()]  # the one restart allowed was used a moment ago
    assert watchdog.restart() is False
    (event,) = [json.loads(line) for line in events.read_text().splitlines()]
    assert (event["event"], event["restarts"]) == ("gave_up", 0)
    assert "1 restarts within 600 s: a crash loop" in event["reason"]
