"""Headless Chromium for the web playground tests: Debian's ``chromium`` driven by Selenium through
Debian's ``chromium-driver`` (version-matched, and nothing is downloaded)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def chromium_paths() -> tuple[str, str] | None:
    """(browser, driver), or None when either is missing."""
    browser = os.environ.get("LLMKIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    driver = os.environ.get("LLMKIT_CHROMEDRIVER") or shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def artifacts_dir() -> Path:
    """Where screenshots are kept (``LLMKIT_TEST_ARTIFACTS``, default ``test-artifacts/``)."""
    path = Path(os.environ.get("LLMKIT_TEST_ARTIFACTS", ROOT / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_chromium(browser: str, driver: str, width: int = 1200, height: int = 800):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
    ):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=opts)
