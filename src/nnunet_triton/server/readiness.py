"""The one wait for Triton's readiness: ``GET /v2/health/ready`` polled until it answers 200 or a deadline.

Every target waits through :func:`wait_ready`: the embedded server (``server.embedded``), its watchdog after a
restart (``server.watchdog``), a docker/podman container and a ``podman kube play`` pod
(``server.deploy.service``). What differs between them is only how to tell that the server is gone for good
(a process exited, a container stopped): the caller's ``gone`` callback says so, and the wait ends at once
instead of at the deadline.
"""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from nnunet_triton.errors import ServerError

__all__ = ["READY_PATH", "READY_TIMEOUT_S", "NotReadyError", "probe_ready", "ready_url", "wait_ready"]

LOGGER = logging.getLogger(__name__)
READY_PATH = "/v2/health/ready"
# The one ready deadline: how long a starting server (model loading included) has to answer ready before the
# start counts as failed. The default of `serve --ready-timeout`, `deploy --ready-timeout`, the embedded
# launcher (LaunchOptions.ready_timeout_s, DeployPlan.ready_timeout) and the watchdog's restart. A server
# that exits is noticed at once (``gone``), so the deadline only bounds a server that hangs while loading.
READY_TIMEOUT_S = 600.0
_NOT_ASKED = "no answer yet"


class NotReadyError(ServerError):
    """The server did not answer ready: the deadline passed or it is gone (``url`` and ``last_answer`` say
    where it was asked and what it answered last)."""

    def __init__(self, message: str, *, url: str, last_answer: str) -> None:
        super().__init__(message)
        self.url = url
        self.last_answer = last_answer


def ready_url(http: str) -> str:
    """Triton's readiness URL of the HTTP endpoint ``host:port``."""
    return f"http://{http}{READY_PATH}"


def probe_ready(url: str, timeout_s: float = 2.0) -> str | None:
    """Ask ``url`` once: None when it answers 200, else what it answered (status and body, or the error)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes via a proxy
    try:
        with opener.open(url, timeout=timeout_s) as response:
            if response.status == 200:
                return None
            return f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        body = exc.read(200).decode("utf-8", errors="replace").strip()
        return f"HTTP {exc.code}" + (f" {body}" if body else "")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"no answer ({reason})"


def wait_ready(http: str, *, timeout_s: float, gone: Callable[[], str | None] | None = None,
               what: str = "tritonserver", interval_s: float = 0.2) -> float:
    """Poll ``http://<http>/v2/health/ready`` until it answers 200; the seconds it took.

    Args:
        http: the server's HTTP endpoint, ``host:port``.
        timeout_s: the deadline, counted from the call (model loading included).
        gone: called between polls; a text (e.g. ``"tritonserver exited (code 1)"``) ends the wait at once:
            the server will never be ready. None: only the deadline ends it.
        what: the server's name in the error.
        interval_s: the pause between polls.

    Raises:
        NotReadyError: ``gone`` gave a reason, or the deadline passed; the message names the URL and the
            last answer.
    """
    url, start = ready_url(http), time.monotonic()
    deadline, last = start + timeout_s, _NOT_ASKED
    while True:
        answer = probe_ready(url)
        if answer is None:
            return time.monotonic() - start
        last = answer
        reason = gone() if gone is not None else None
        if reason is not None:
            raise NotReadyError(f"{reason} before {url} was ready (last answer: {last})", url=url,
                                last_answer=last)
        if time.monotonic() > deadline:
            raise NotReadyError(f"{what} was not ready at {url} after {timeout_s:.0f} s "
                                f"(last answer: {last})", url=url, last_answer=last)
        time.sleep(interval_s)
