"""When to start a tritonserver that exited without being stopped again, and when to give up.

The embedded watchdog (``server.watchdog``) restarts the server with the config it was launched with
(``LaunchSpec``: its ``TritonServerConfig``, written 0600 by the launcher as ``launch.json`` next to
``server.json``). Consecutive restarts wait 0, 1, 2,
4, ... up to 30 s; more than ``max_restarts`` restarts within ``window_s`` is a crash loop: the watchdog
stops restarting and says so. Containers and Kubernetes keep their own restart policies (there tritonserver
is PID 1 and its exit ends the container). Only the standard library and the project's core.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nnunet_triton.server.preload import PLACEHOLDER
from nnunet_triton.server.server_config import TritonServerConfig
from nnunet_triton.util.durable import write_json_atomic
from nnunet_triton.util.retry import RetryPolicy

__all__ = ["LaunchSpec", "RestartPolicy"]

MAX_RESTARTS = 5
WINDOW_S = 600.0
MAX_DELAY_S = 30.0


@dataclass
class RestartPolicy:
    """Backoff between restarts and the crash-loop limit (``max_restarts`` within ``window_s``)."""

    max_restarts: int = MAX_RESTARTS
    window_s: float = WINDOW_S
    max_delay_s: float = MAX_DELAY_S
    restarts: list[float] = field(default_factory=list)  # monotonic times of the restarts granted

    def __post_init__(self) -> None:
        if self.max_restarts < 1 or self.window_s <= 0 or self.max_delay_s < 0:
            raise ValueError(f"max_restarts must be >= 1, window_s > 0 and max_delay_s >= 0, got "
                             f"{self.max_restarts}, {self.window_s} and {self.max_delay_s}.")

    def recent(self, now: float) -> int:
        """Restarts granted within the window ending at ``now``."""
        return sum(1 for t in self.restarts if now - t < self.window_s)

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next restart (granting it), or None: a crash loop, give up."""
        recent = self.recent(now)
        if recent >= self.max_restarts:
            return None
        self.restarts = [t for t in self.restarts if now - t < self.window_s] + [now]
        if recent == 0:
            return 0.0
        return RetryPolicy(backoff_s=1.0, max_delay_s=self.max_delay_s).delay(recent - 1)

    def describe_give_up(self) -> str:
        return (f"{self.max_restarts} restarts within {self.window_s:.0f} s: a crash loop, not restarting "
                f"again (read the server log, fix the cause, then start it again)")


@dataclass(frozen=True)
class LaunchSpec:
    """How to start the same tritonserver again: its ``server_config.TritonServerConfig`` and the environment
    it had on top of the watchdog's (the control token is in neither: the watchdog passes its own)."""

    server: TritonServerConfig
    environment: Mapping[str, str]
    log_file: str
    pid_file: str | None
    state_file: str | None

    @property
    def command(self) -> tuple[str, ...]:
        return tuple(self.server.to_args())

    @classmethod
    def for_server(cls, server: TritonServerConfig, server_env: Mapping[str, str],
                   base_env: Mapping[str, str], *,
                   log_file: str | Path, pid_file: str | Path | None, state_file: str | Path | None,
                   secret_keys: Sequence[str] = ()) -> LaunchSpec:
        extra = {k: v for k, v in server_env.items() if base_env.get(k) != v and k not in secret_keys}
        return cls(server, extra, str(log_file), None if pid_file is None else str(pid_file),
                   None if state_file is None else str(state_file))

    def write(self, path: str | Path) -> None:
        """``path`` as JSON, 0600 from the start, atomically; a real token is not written (the preload
        placeholder is)."""
        write_json_atomic(path, {"server": self.server.to_dict(keep_token=PLACEHOLDER),
                                 "environment": dict(self.environment), "log_file": self.log_file,
                                 "pid_file": self.pid_file, "state_file": self.state_file}, mode=0o600)

    @classmethod
    def read(cls, path: str | Path, *, token: str | None = None) -> LaunchSpec:
        """The spec :meth:`write` wrote; ``token`` is the control token when the server's flags carry it."""
        data = json.loads(Path(path).read_text())
        return cls(TritonServerConfig.from_dict(data["server"], token=token), dict(data["environment"]),
                   data["log_file"], data.get("pid_file"), data.get("state_file"))
