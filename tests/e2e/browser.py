"""A headless Chromium for the page tests: Debian's ``chromium`` driven through its ``chromedriver``
(selenium); nothing downloads a browser. Blocking calls: run them in a thread."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

__all__ = ["ARTIFACTS", "browser_missing", "open_chromium", "severe_logs"]

ARTIFACTS = Path("test-artifacts")


def browser_missing() -> str | None:
    """Why no browser test can run here (None: it can)."""
    for exe in ("chromium", "chromedriver"):
        if shutil.which(exe) is None:
            return f"`{exe}` is not installed (apt-get install -y chromium chromium-driver; .ci/run does)"
    return None


def open_chromium(url: str, user_data: Path, *, size: str = "1200,900") -> Any:
    """A headless Chromium (its console log kept) on ``url``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--window-size={size}", f"--user-data-dir={user_data}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=opts)
    driver.get(url)
    return driver


def severe_logs(driver: Any) -> list[dict[str, Any]]:
    """The console's errors since the last call (a CSP violation is one)."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
