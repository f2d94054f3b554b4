"""Triton's model-control API (``--model-control-mode=explicit``) of one server, with the launcher's token:
load, unload, readiness and the repository index. The watchdog reloads a model whose process died with it,
``server.rollout`` loads, promotes and removes endpoint versions with it, ``info`` lists the loaded endpoints.

Only the standard library (the watchdog runs it in containers).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nnunet_triton.errors import ServerError, ServerNotRunningError
from nnunet_triton.server import server_config

__all__ = ["CONTROL_HEADER", "RESTRICTED_APIS", "TOKEN_ENV", "ModelControl", "restricted_api_args"]

# Triton's gRPC frontend expects a restricted protocol's key with the prefix "triton-grpc-protocol-" added
# (the flag names the key without it); HTTP takes the key as given. The HTTP key carries the prefix, so one
# header works on both protocols.
_GRPC_PREFIX = server_config.GRPC_PROTOCOL_PREFIX
CONTROL_HEADER = f"{_GRPC_PREFIX}nnunet-control"
TOKEN_ENV = "NNUNET_TRITON_CONTROL_TOKEN"
# Triton's API groups that need the token: loading code (model-repository), reading or writing other
# processes' memory (shared-memory, system and CUDA), switching logs off or traces on (logging, trace) and
# the per-model counters (statistics). Health, metadata, model-config (clients read the endpoint's inputs
# from it) and inference stay open.
RESTRICTED_APIS = ("model-repository", "shared-memory", "statistics", "trace", "logging")


def restricted_api_args(token: str, apis: tuple[str, ...] = RESTRICTED_APIS) -> list[str]:
    """tritonserver flags that allow ``apis`` on HTTP and gRPC only with ``CONTROL_HEADER: token``."""
    return server_config.restricted_api_args(apis, CONTROL_HEADER, token)


@dataclass(frozen=True)
class ModelControl:
    """Triton's model-control API of one server (``--model-control-mode=explicit``) and its token."""

    url: str  # host:port of the HTTP endpoint
    token: str | None = None
    timeout_s: float = 900.0  # a load waits for the model's stubs (torch imports, warm-up)

    def _open(self, request: urllib.request.Request) -> tuple[int, bytes]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, OSError) as exc:
            raise ServerNotRunningError(f"the server at {self.url} is not reachable: {exc}.") from None

    @property
    def headers(self) -> dict[str, str]:
        """The header every restricted API (``RESTRICTED_APIS``) needs; empty without a token."""
        return {CONTROL_HEADER: self.token} if self.token else {}

    def _post(self, path: str, body: Mapping[str, Any] | None = None) -> tuple[int, bytes]:
        """POST ``body`` (default ``{}``) to the model-repository API with the token."""
        headers = {"Content-Type": "application/json", **self.headers}
        data = json.dumps(body or {}).encode()
        return self._open(urllib.request.Request(f"http://{self.url}{path}", data=data, method="POST",
                                                 headers=headers))

    def statistics(self, model: str | None = None) -> dict[str, Any]:
        """Triton's statistics (``GET /v2/models[/<model>]/stats``) of every model or of ``model``."""
        path = "/v2/models/stats" if model is None else f"/v2/models/{urllib.parse.quote(model)}/stats"
        status, body = self._open(urllib.request.Request(f"http://{self.url}{path}", headers=self.headers))
        if status != 200:
            raise ServerError(f"the statistics of {self.url} answered {status}: "
                              f"{body.decode(errors='replace').strip()}")
        return dict(json.loads(body))

    def config(self, model: str) -> dict[str, Any]:
        """The configuration Triton serves ``model`` with (``GET /v2/models/<model>/config``; open)."""
        url = f"http://{self.url}/v2/models/{urllib.parse.quote(model)}/config"
        status, body = self._open(urllib.request.Request(url))
        if status != 200:
            raise ServerError(f"the config of model {model!r} on {self.url} answered {status}: "
                              f"{body.decode(errors='replace').strip()}")
        return dict(json.loads(body))

    def _control(self, model: str, action: str, request: Mapping[str, Any] | None = None) -> None:
        status, body = self._post(f"/v2/repository/models/{urllib.parse.quote(model)}/{action}", request)
        if status != 200:
            text = body.decode(errors="replace").strip()
            hint = (f" (the model-repository API needs the server's token: ${TOKEN_ENV})"
                    if status in (401, 403) or "restricted" in text.lower() else "")
            raise ServerError(f"{action} of model {model!r} on {self.url} answered {status}: {text}{hint}")

    def load(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        """Load ``model`` (reload it when its files changed; a no-op when loaded and unchanged).

        With ``config`` (JSON model configuration): load it with that configuration instead of its
        config.pbtxt. A loaded model whose configuration changed beyond its instance groups is re-created:
        the new instances load while the old ones keep serving, then replace them; requests in flight
        finish on the old ones (Triton's explicit model control). Returns once the new model is ready."""
        request = None if config is None else {"parameters": {"config": json.dumps(config)}}
        self._control(model, "load", request)

    def unload(self, model: str) -> None:
        self._control(model, "unload")

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index: every model it knows with its state (READY, UNLOADING, ...)."""
        status, body = self._post("/v2/repository/index")
        if status != 200:
            raise ServerError(f"the repository index of {self.url} answered {status}: "
                              f"{body.decode(errors='replace').strip()}")
        return list(json.loads(body))

    def wait_unloaded(self, models: Sequence[str], timeout_s: float = 300.0) -> None:
        """Wait until Triton has finished unloading ``models`` (an unload returns while the model still
        drains its requests; its files must stay until then, and the server is not ready meanwhile)."""
        wanted = set(models)
        deadline = time.monotonic() + timeout_s
        while True:
            busy = sorted(m["name"] for m in self.index() if m.get("name") in wanted
                          and str(m.get("state", "")).upper() in ("UNLOADING", "READY", "LOADING"))
            if not busy:
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{len(busy)} model(s) still not unloaded after {timeout_s:.0f} s: {busy}")
            time.sleep(0.1)

    def ready(self, model: str) -> bool:
        """``GET /v2/models/<model>/ready`` (not restricted)."""
        url = f"http://{self.url}/v2/models/{urllib.parse.quote(model)}/ready"
        return self._open(urllib.request.Request(url))[0] == 200

    def wait_not_ready(self, model: str, timeout_s: float = 60.0) -> None:
        """Wait until ``model`` no longer answers ready (an unload was taken)."""
        deadline = time.monotonic() + timeout_s
        while self.ready(model):
            if time.monotonic() > deadline:
                raise ServerError(f"model {model!r} still ready {timeout_s:.0f} s after its unload")
            time.sleep(0.05)

    @classmethod
    def from_env(cls, url: str) -> ModelControl:
        """The server at ``url`` with the token from ``$NNUNET_TRITON_CONTROL_TOKEN``."""
        return cls(url, os.environ.get(TOKEN_ENV) or None)
