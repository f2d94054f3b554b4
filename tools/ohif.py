"""The OHIF viewer (npm ``@ohif/app``'s prebuilt ``dist/``) served by nginx in front of Orthanc's DICOMweb,
and headless Chromium driven over the DevTools protocol: the browser test of our DICOM-SEG.

* :func:`ensure_ohif` unpacks ``npm pack @ohif/app@OHIF_VERSION`` into ``build/ohif/<version>/dist`` once
  (no build step; the tarball is the built viewer).
* :func:`start_viewer` runs nginx on a free loopback port: ``/`` serves the viewer (``try_files`` to
  ``index.html``), ``/app-config.js`` our config (the default data source is ``/dicom-web`` on the same
  origin, ``staticWado`` off), and ``/dicom-web/`` is proxied to Orthanc with its credentials and the
  page's ``Host`` (else Orthanc writes BulkDataURIs with its own port and they become cross-origin).
* :class:`Browser` is headless Chromium (``--remote-debugging-port``) with the few DevTools calls a test
  needs: navigate, evaluate JavaScript (awaiting promises), capture a screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.orthanc import PASSWORD, USER, Orthanc, free_port

OHIF_VERSION = "3.13.2"

APP_CONFIG = """window.config = {
  name: 'nnunet-triton tests',
  routerBasename: '/',
  extensions: [],
  modes: [],
  customizationService: {},
  showStudyList: true,
  maxNumberOfWebWorkers: 1,
  showWarningMessageForCrossOrigin: false,
  showCPUFallbackMessage: false,
  showLoadingIndicator: true,
  strictZSpacingForVolumeViewport: true,
  defaultDataSourceName: 'orthanc',
  dataSources: [{
    namespace: '@ohif/extension-default.dataSourcesModule.dicomweb',
    sourceName: 'orthanc',
    configuration: {
      friendlyName: 'Orthanc', name: 'orthanc',
      wadoUriRoot: '/dicom-web', qidoRoot: '/dicom-web', wadoRoot: '/dicom-web',
      qidoSupportsIncludeField: false, imageRendering: 'wadors', thumbnailRendering: 'wadors',
      enableStudyLazyLoad: true, supportsFuzzyMatching: false, supportsWildcard: true,
      staticWado: false, singlepart: 'bulkdata,video',
      bulkDataURI: {enabled: true, relativeResolution: 'studies'},
      omitQuotationForMultipartRequest: true,
    },
  }],
};
"""


def ensure_ohif(build: Path) -> Path | None:
    """``build/ohif/<version>/dist`` (unpacked from ``npm pack`` when missing); None without npm."""
    dist = build / "ohif" / OHIF_VERSION / "dist"
    if (dist / "index.html").is_file():
        return dist
    npm = shutil.which("npm")
    if npm is None:
        return None
    with tempfile.TemporaryDirectory(dir=build) as work:
        subprocess.run([npm, "pack", f"@ohif/app@{OHIF_VERSION}"], cwd=work, check=True, capture_output=True,
                       timeout=900)
        (tarball,) = Path(work).glob("ohif-app-*.tgz")
        with tarfile.open(tarball) as archive:
            archive.extractall(work, filter="data")
        dist.parent.mkdir(parents=True, exist_ok=True)
        (Path(work) / "package" / "dist").rename(dist)
    return dist


def chromium() -> str | None:
    """Debian's chromium, installed with apt when missing (as root); None when it cannot be had."""
    found = shutil.which("chromium")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"],
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True,
                       timeout=900, check=False)
        found = shutil.which("chromium")
    return found


@dataclass
class Viewer:
    """nginx serving OHIF on ``url``, its DICOMweb proxied to Orthanc."""

    url: str
    process: subprocess.Popen
    folder: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def start_viewer(dist: Path, orthanc: Orthanc, folder: Path) -> Viewer:
    """nginx (foreground, its files in ``folder``) serving ``dist`` with our config, proxying DICOMweb."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "app-config.js").write_text(APP_CONFIG)
    port = free_port()
    credentials = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    temp = {name: folder / name for name in ("client", "proxy", "fastcgi", "uwsgi", "scgi")}
    for path in temp.values():
        path.mkdir(exist_ok=True)
    config = f"""
daemon off;
worker_processes 1;
{"user root;" if os.geteuid() == 0 else ""}
pid {folder / "nginx.pid"};
error_log {folder / "error.log"} warn;
events {{ worker_connections 256; }}
http {{
  include /etc/nginx/mime.types;
  types {{ application/wasm wasm; }}
  access_log {folder / "access.log"};
  client_body_temp_path {temp["client"]}; proxy_temp_path {temp["proxy"]};
  fastcgi_temp_path {temp["fastcgi"]}; uwsgi_temp_path {temp["uwsgi"]}; scgi_temp_path {temp["scgi"]};
  server {{
    listen 127.0.0.1:{port};
    root {dist.resolve()};
    location = /app-config.js {{ alias {folder / "app-config.js"}; }}
    location /dicom-web/ {{
      proxy_pass http://127.0.0.1:{orthanc.http_port}/dicom-web/;
      proxy_set_header Host $http_host;
      proxy_set_header Authorization "Basic {credentials}";
      proxy_read_timeout 300s;
    }}
    location / {{ try_files $uri /index.html; }}
  }}
}}
"""
    (folder / "nginx.conf").write_text(config)
    log = (folder / "nginx.out").open("w")
    process = subprocess.Popen([nginx, "-c", str(folder / "nginx.conf"), "-p", str(folder)], stdout=log,
                               stderr=subprocess.STDOUT)
    viewer = Viewer(f"http://127.0.0.1:{port}", process, folder)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nginx exited with {process.returncode}: "
                               f"{(folder / 'nginx.out').read_text()[-2000:]}")
        try:
            _get(viewer.url + "/app-config.js", timeout=5)
            return viewer
        except OSError:
            time.sleep(0.2)
    viewer.stop()
    raise RuntimeError("nginx did not answer within 30 s")


def _get(url: str, timeout: float = 30.0) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        return response.read()


class Browser:
    """Headless Chromium and one page, driven over the DevTools protocol (``websocket-client``)."""

    def __init__(self, binary: str, folder: Path, *, width: int = 1280, height: int = 900) -> None:
        import websocket

        self.port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        self.log = (folder / "chromium.log").open("w")
        self.process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-unsafe-swiftshader",
             "--use-angle=swiftshader", f"--remote-debugging-port={self.port}", "--remote-allow-origins=*",
             f"--user-data-dir={folder / 'profile'}", f"--window-size={width},{height}",
             "--no-first-run", "--no-default-browser-check", "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        page = None
        while page is None and time.monotonic() < deadline:
            try:
                targets = json.loads(_get(f"http://127.0.0.1:{self.port}/json", timeout=5))
                page = next((t for t in targets if t.get("type") == "page"), None)
            except OSError:
                time.sleep(0.3)
        if page is None:
            self.close()
            raise RuntimeError("chromium did not open its DevTools port within 60 s")
        self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=120,
                                                  suppress_origin=True)
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.socket.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:  # events arrive between the answers; only the answer to this call is returned
            message = json.loads(self.socket.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def navigate(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str, *, timeout_s: float = 60.0) -> Any:
        """The value of a JavaScript expression (a promise is awaited); RuntimeError on an exception."""
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True,
                           timeout=int(timeout_s * 1000))
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript failed: {json.dumps(result['exceptionDetails'])[:2000]}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, *, timeout_s: float = 120.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")

    def click(self, selector: str, *, count: int = 1, text: str | None = None) -> None:
        """A real mouse click (``count`` 2: a double click) on the centre of the first element matching
        ``selector`` (and containing ``text``), as a user's: React handles only trusted events."""
        where = self.evaluate(
            f"(() => {{ const e = Array.from(document.querySelectorAll({json.dumps(selector)}))"
            f".find(e => {json.dumps(text)} === null || e.textContent.includes({json.dumps(text)}));"
            " if (!e) return null; e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        if where is None:
            raise AssertionError(f"no element {selector!r}" + (f" with text {text!r}" if text else ""))
        x, y = where
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for clicks in range(1, count + 1):
            for kind in ("mousePressed", "mouseReleased"):
                self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=clicks)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if getattr(self, "socket", None) is not None:
                self.socket.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
            self.log.close()
