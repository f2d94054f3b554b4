"""``server.readiness.wait_ready``: the one readiness wait of every target, against a real HTTP server."""

from __future__ import annotations

import ast
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nnunet_triton.errors import ServerError
from nnunet_triton.server import readiness

SRC = Path(__file__).resolve().parents[2] / "src"
# what a readiness poll mentions: the path, the helpers that ask it once
_READINESS = re.compile(r"health/ready|READY_PATH|ready_url\(|probe_ready\(|is_ready\(|_http_ok\(")


class _Triton(BaseHTTPRequestHandler):
    """``/v2/health/ready``: 503 for the first ``not_ready`` requests, then 200."""

    not_ready = 0
    asked = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).asked += 1
        ready = type(self).asked > type(self).not_ready
        body = b"" if ready else b'{"error":"Server not ready"}'
        self.send_response(200 if ready else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def triton() -> Iterator[tuple[str, type[_Triton]]]:
    handler = type("Handler", (_Triton,), {"not_ready": 0, "asked": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wait_ready_polls_until_the_ready_endpoint_answers_200(triton) -> None:
    http, handler = triton
    handler.not_ready = 3
    readiness.wait_ready(http, timeout_s=60, interval_s=0.01)
    assert handler.asked == 4


def test_wait_ready_past_its_deadline_names_the_url_and_the_last_answer(triton) -> None:
    http, handler = triton
    handler.not_ready = 10**6
    with pytest.raises(readiness.NotReadyError) as error:
        readiness.wait_ready(http, timeout_s=0, what="container x")
    url = f"http://{http}/v2/health/ready"
    assert str(error.value) == (f'container x was not ready at {url} after 0 s '
                                f'(last answer: HTTP 503 {{"error":"Server not ready"}})')
    assert (error.value.url, error.value.last_answer) == (url, 'HTTP 503 {"error":"Server not ready"}')
    assert isinstance(error.value, ServerError)


def test_wait_ready_ends_at_once_when_the_server_is_gone() -> None:
    http = f"127.0.0.1:{_closed_port()}"
    calls = []

    def gone() -> str | None:
        calls.append(1)
        return "tritonserver exited (code 3)" if len(calls) == 2 else None

    expected = (rf"^tritonserver exited \(code 3\) before http://{http}/v2/health/ready was ready "
                r"\(last answer: no answer \(.*\)\)$")
    with pytest.raises(readiness.NotReadyError, match=expected):
        readiness.wait_ready(http, timeout_s=3600, gone=gone, interval_s=0.01)
    assert len(calls) == 2


def _functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Module-level functions and methods (nested functions are part of theirs)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            functions = (ast.FunctionDef, ast.AsyncFunctionDef)
            yield from (item for item in node.body if isinstance(item, functions))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _readiness_polls() -> list[str]:
    """Every function in src/ with a ``while`` loop that asks Triton's readiness: ``file:function``."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if not _READINESS.search(text):
            continue
        for function in _functions(ast.parse(text)):
            if not any(isinstance(node, ast.While) for node in ast.walk(function)):
                continue
            code = ast.get_source_segment(text, function) or ""
            if ast.get_docstring(function):
                code = code.split('"""', 2)[-1]  # what the function does, not what it says
            if _READINESS.search(code):
                found.append(f"{path.relative_to(SRC).as_posix()}:{function.name}")
    return found


def test_one_readiness_poll_loop_in_the_package() -> None:
    assert _readiness_polls() == ["nnunet_triton/server/readiness.py:wait_ready"]
