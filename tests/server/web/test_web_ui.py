"""The web playground at ``/``, for real: headless Chromium against a real ``llmkit serve`` (a
reasoning template, a tool parser and an API key), driven with Selenium. A screenshot is kept in
the artifacts directory (printed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from browser_utils import artifacts_dir, chromium_paths, start_chromium
from metrics_utils import parse_metrics, value
from server_utils import start_server, stop_server

TEMPLATE = Path(__file__).resolve().parents[2] / "data" / "think_template.jinja"
KEY = "playground-key"
M = "web-model"
PATHS = chromium_paths()
pytestmark = pytest.mark.skipif(
    PATHS is None, reason="chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def url():
    proc, base = start_server(
        [
            "--served-model-name",
            M,
            "--chat-template",
            str(TEMPLATE),
            "--reasoning-parser",
            "qwen3",
            "--tool-call-parser",
            "hermes",
            "--api-key",
            KEY,
            "--batch-storage",
            "none",
        ]
    )
    try:
        yield base
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def page(url):
    from selenium.webdriver.common.by import By

    driver = start_chromium(*PATHS, height=900)
    try:
        driver.get(url + "/")
        wait_for(lambda: driver.find_element(By.ID, "key-dialog").get_attribute("open") is not None)
        driver.find_element(By.ID, "api-key").send_keys(KEY)
        driver.find_element(By.ID, "save-key").click()
        wait_for(lambda: driver.find_element(By.ID, "model-name").text == M)
        yield driver
    finally:
        driver.quit()


def wait_for(cond, timeout: float = 120.0, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s")


def setting(page, element_id: str, value_: str) -> None:
    el = page.find_element("id", element_id)
    page.execute_script("arguments[0].value = arguments[1];arguments[0].dispatchEvent(new Event('input'))", el, value_)


def check(page, element_id: str, on: bool) -> None:
    el = page.find_element("id", element_id)
    if el.is_selected() != on:
        el.click()


def send(page, text: str) -> None:
    n = len(page.find_elements("css selector", ".msg.assistant"))
    page.find_element("id", "prompt").send_keys(text)
    page.find_element("id", "send").click()
    wait_for(lambda: len(page.find_elements("css selector", ".msg.assistant")) == n + 1)


def last_answer(page):
    return page.find_elements("css selector", ".msg.assistant")[-1]


def done(page) -> bool:
    return page.find_element("id", "send").is_displayed()


def metrics(url: str) -> dict:
    return parse_metrics(httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text)


def test_streams_text_then_stop_aborts(page, url):
    check(page, "thinking", False)
    setting(page, "temperature", "0")
    setting(page, "max-tokens", "400")
    send(page, "Tell me a very long story about a dragon who learns to cook.")
    content = lambda: last_answer(page).find_element("css selector", ".content").text  # noqa: E731
    first = wait_for(lambda: content())
    wait_for(lambda: len(content()) > len(first))  # more text arrives while it streams
    assert page.find_element("id", "stop").is_displayed() and not done(page)
    page.find_element("id", "stop").click()
    wait_for(lambda: done(page), timeout=30)
    stats = last_answer(page).find_element("css selector", ".stats").text
    assert "stopped" in stats and "TTFT" in stats
    # closing the stream aborted the request on the server
    wait_for(lambda: value(metrics(url), "llmkit:request_aborted_total", model_name=M) == 1, timeout=30, poll=0.3)


def test_reasoning_collapses(page):
    check(page, "thinking", True)
    setting(page, "temperature", "0")
    setting(page, "max-tokens", "24")
    send(page, "Which is greater, 9.11 or 9.8?")
    wait_for(lambda: done(page))
    answer = last_answer(page)
    details = answer.find_element("css selector", "details.reasoning")
    assert details.get_attribute("open") is None  # collapsed once the answer ended
    assert answer.find_element("css selector", ".reasoning-text").get_attribute("textContent").strip()
    stats = answer.find_element("css selector", ".stats").text
    assert "tok/s" in stats and "TTFT" in stats and "tokens" in stats


def test_tool_calls_are_shown_as_such_and_screenshot(page):
    check(page, "thinking", False)
    setting(page, "max-tokens", "64")
    setting(page, "tools", json.dumps(TOOLS))
    check(page, "tool-required", True)
    try:
        send(page, "What is the weather in Paris?")
        wait_for(lambda: done(page))
        call = last_answer(page).find_element("css selector", ".tool-call").text
        assert call.startswith("tool call: get_weather(") and '"city"' in call
        path = artifacts_dir() / "playground.png"  # the whole conversation: streamed, stopped, reasoning, tool call
        page.save_screenshot(str(path))
        print(f"\nplayground screenshot: {path}")
        assert path.stat().st_size > 10_000
    finally:
        setting(page, "tools", "")
        check(page, "tool-required", False)


def test_page_and_files_are_public_the_api_is_not(url):
    assert httpx.get(url + "/", timeout=30).status_code == 200
    assert httpx.get(url + "/web/app.js", timeout=30).headers["content-type"].startswith("text/javascript")
    assert httpx.get(url + "/web/web_ui.py", timeout=30).status_code == 404  # only the shipped files
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
