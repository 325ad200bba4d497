"""The dashboard as tests reach it: HTTPS requests verified with the data dir's CA, and a headless Chromium
(Debian's `chromium` and `chromium-driver`) driven by Selenium."""

from __future__ import annotations

import contextlib
import os
import shutil
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ballast.tls import tls_files
from tests.harness import Plane

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: str


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a test looks at the redirect itself
        return None


@dataclass
class Site:
    """The dashboard at `url`, over TLS verified with `ca`."""

    url: str
    ca: Path

    def request(self, path: str, *, data: bytes | None = None, headers: dict[str, str] | None = None) -> Reply:
        context = ssl.create_default_context(cafile=str(self.ca))
        opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context), _NoRedirect)
        request = urllib.request.Request(self.url.rstrip("/") + path, data=data, headers=headers or {})
        try:
            with opener.open(request, timeout=30) as reply:
                return Reply(reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read().decode())
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read().decode())

    def get(self, path: str, token: str = "", html: bool = True) -> Reply:
        headers = {"accept": "text/html"} if html else {}
        if token:
            headers["authorization"] = f"Bearer {token}"
        return self.request(path, headers=headers)


@contextlib.contextmanager
def dashboard(plane: Plane) -> Iterator[Site]:
    """The dashboard serving in this process against `plane`, stopped on exit."""
    from services.dashboard.service import start

    running = start(plane.settings)
    try:
        yield Site(running.url, tls_files(plane.settings).ca)
    finally:
        running.stop()


def need_chromium() -> None:
    """Skip (fail in CI) when the system Chromium or its driver is missing."""
    missing = [p for p in CHROMIUM if not (Path(p).exists() or shutil.which(Path(p).name))]
    if missing:
        message = f"missing {', '.join(missing)}; install them: {INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@contextlib.contextmanager
def browser(width: int = 1400, height: int = 1000) -> Iterator[object]:
    """A fresh headless Chromium (no cookies). The dashboard's certificate is signed by the data dir's local
    CA, which this browser profile does not hold, so certificate errors are accepted; the HTTPS tests verify
    the certificate against the CA instead."""
    need_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or CHROMIUM[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.accept_insecure_certs = True
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or CHROMIUM[1]))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
