"""One retry policy: which Triton answers are worth retrying (by status code) and how long to wait.

A request is retried when its Triton status code is UNAVAILABLE (overloaded, model reloading, out of
memory) and never for any other code (a bad request stays bad). The code comes in three spellings,
:func:`triton_code` reads them all: gRPC (``StatusCode.UNAVAILABLE``), HTTP (``503``) and Triton's own
names (``UNAVAILABLE``, as in ``NnunetTritonError.triton_code``).

One exception is Triton's, not ours: a composing model that is not running (its stub died, it is being
reloaded) is reported as INTERNAL or NOT_FOUND with a fixed wording (``NOT_RUNNING_MESSAGES``), although
the server's watchdog repairs it within seconds. :func:`triton_code` re-codes exactly those answers
UNAVAILABLE, so the decision everywhere else is by code only.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from nnunet_triton.errors import NOT_RUNNING_MESSAGES, ClientError, ServerUnavailableError

__all__ = ["RETRYABLE_CODES", "RetryPolicy", "TritonCode", "is_retryable", "is_retryable_error",
           "triton_code"]

LOGGER = logging.getLogger(__name__)
T = TypeVar("T")


class TritonCode(str, enum.Enum):  # noqa: UP042 - StrEnum is 3.11, the image stub runs 3.10
    """Triton's error codes (``TRITONSERVER_Error_Code``), by name (``.value``)."""

    UNKNOWN = "UNKNOWN"
    INTERNAL = "INTERNAL"
    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"


RETRYABLE_CODES = frozenset({TritonCode.UNAVAILABLE})

# Triton's HTTP endpoint answers an error with the HTTP status of its code (tritonclient reports it as text).
# 429: the TLS proxy's per-client limits (server.proxy_config.ClientLimits): busy for now, like 503.
_HTTP_CODES = {"400": TritonCode.INVALID_ARG, "404": TritonCode.NOT_FOUND, "429": TritonCode.UNAVAILABLE,
               "500": TritonCode.INTERNAL, "503": TritonCode.UNAVAILABLE}
_GRPC_CODES = {"INVALID_ARGUMENT": TritonCode.INVALID_ARG, "UNIMPLEMENTED": TritonCode.UNSUPPORTED}
# The codes Triton gives a composing model that is not running (see the module docstring).
_NOT_RUNNING_CODES = frozenset({TritonCode.INTERNAL, TritonCode.NOT_FOUND, TritonCode.UNKNOWN})


def triton_code(status: object, message: str = "") -> TritonCode | None:
    """The Triton code of an answer: ``status`` as gRPC (``StatusCode.UNAVAILABLE``), HTTP (``503``) or
    Triton name (``UNAVAILABLE``); None when there was no answer (``status`` None: the server was not
    reached). ``message`` is only read to re-code Triton's not-running answers UNAVAILABLE."""
    if status is None:
        return None
    text = (status.value if isinstance(status, TritonCode) else str(status)).strip()
    text = text.removeprefix("StatusCode.").upper()
    code = _HTTP_CODES.get(text) or _GRPC_CODES.get(text)
    if code is None:
        code = TritonCode(text) if text in TritonCode.__members__ else TritonCode.UNKNOWN
    if code in _NOT_RUNNING_CODES and any(words in message for words in NOT_RUNNING_MESSAGES):
        return TritonCode.UNAVAILABLE
    return code


def is_retryable(code: TritonCode | str | None) -> bool:
    """Whether an answer with this Triton code may succeed when sent again later."""
    return code in RETRYABLE_CODES


def is_retryable_error(exc: BaseException) -> bool:
    """Whether a failed client call may succeed later: a :class:`ServerUnavailableError`, or a
    :class:`ClientError` whose status is a retryable code (for errors raised by other clients)."""
    if isinstance(exc, ServerUnavailableError):
        return True
    return isinstance(exc, ClientError) and is_retryable(triton_code(exc.status, str(exc)))


@dataclass(frozen=True)
class RetryPolicy:
    """Up to ``retries`` retries after the first attempt, waiting ``backoff_s * 2**n`` before retry
    ``n + 1`` (at most ``max_delay_s``)."""

    retries: int = 3
    backoff_s: float = 2.0
    max_delay_s: float = math.inf

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.max_delay_s < 0:
            raise ValueError("retries, backoff and maximum delay must be >= 0, got "
                             f"{self.retries}, {self.backoff_s}, {self.max_delay_s}.")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt + 1`` (``attempt`` counts from 0)."""
        return min(self.max_delay_s, self.backoff_s * 2**attempt)

    def call(self, func: Callable[[], T], *, retryable: Callable[[BaseException], bool] = is_retryable_error,
             sleep: Callable[[float], None] = time.sleep) -> T:
        """``func()``, retried while it raises an exception ``retryable`` accepts and retries are left;
        the last exception (or the first one not retryable) propagates."""
        attempt = 0
        while True:
            try:
                return func()
            except Exception as exc:
                if attempt >= self.retries or not retryable(exc):
                    raise
                delay = self.delay(attempt)
                attempt += 1
                LOGGER.warning("server UNAVAILABLE (%s); retry %d/%d in %.1f s", exc, attempt, self.retries,
                               delay)
                sleep(delay)
