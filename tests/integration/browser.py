"""A real headless browser for `rv ui`'s tests: Debian's chromium driven through Debian's chromedriver
(scripts/test installs both), by Selenium. Nothing is downloaded: the driver's path is given, so
Selenium Manager is never asked to find or fetch one.

Screenshots go to tests/artifacts/ui/ (ignored by git; RV_UI_SCREENSHOTS moves it), one PNG per page a
test looks at, named by the test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = Path(os.environ.get("RV_UI_SCREENSHOTS") or REPO / "tests" / "artifacts" / "ui")
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A headless Chromium with a fresh profile folder, closed (and the folder removed) at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            raise AssertionError(
                f"{path} is missing: scripts/test installs Debian's chromium and chromium-driver"
            )
    profile = tempfile.mkdtemp(prefix="rv-ui-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # As root and on a machine with no network: no sandbox (root), no GPU, nothing that phones home.
    for arg in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", "--no-default-browser-check", "--disable-extensions",
        f"--user-data-dir={profile}", f"--window-size={width},{height}",
    ):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def screenshot(driver: Any, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def wait_until(predicate: Callable[[], T], timeout: float, what: str, step: float = 0.2) -> T:
    """``predicate()``'s first true value (exceptions count as not yet); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as exc:  # the page is still drawing: an element not there yet, a stale one
            last = exc
        else:
            if value:
                return value
        time.sleep(step)
    raise AssertionError(
        f"timed out after {timeout:.0f} s waiting for {what}" + (f" (last: {last!r})" if last else "")
    )
