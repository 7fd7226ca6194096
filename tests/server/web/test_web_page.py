"""The playground's page and files, in-process on the real app (the browser tests are in
test_web_ui.py): served at /, self-contained (nothing from a CDN), switched off by --disable-web-ui."""

from __future__ import annotations

import json
import re

import pytest

from fake_engine import fake_app


def _client(**config):
    from fastapi.testclient import TestClient

    return TestClient(fake_app(**config))


def _config(html: str) -> dict:
    return json.loads(re.search(r'id="llmkit-config">(.*?)</script>', html).group(1))


@pytest.mark.parametrize("key", [None, "k"])
def test_page_is_served_and_says_whether_a_key_is_needed(key):
    with _client(api_keys=(key,) if key else ()) as client:
        r = client.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert _config(r.text) == {"auth": key is not None}
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
            assert client.get(f"/web/{name}").headers["content-type"].startswith(kind)
        assert client.get("/web/nothing.js").status_code == 404


def test_nothing_is_fetched_from_elsewhere():
    with _client() as client:
        for path in ("/", "/web/app.js", "/web/style.css"):
            text = client.get(path).text
            assert not re.search(r"(src|href)=[\"']?(https?:)?//", text), path
            assert not re.search(r"(import|fetch)\(?\s*[\"'`]https?://", text), path


def test_disable_web_ui():
    with _client(enable_web_ui=False, api_keys=("k",)) as client:
        assert client.get("/", headers={"Authorization": "Bearer k"}).status_code == 404
        assert client.get("/web/app.js").status_code == 401  # no longer public


def test_page_sends_a_content_security_policy_and_nosniff():
    """The page may run only its own module and reach only this server; no file is sniffed into
    another type. (test_web_ui.py drives the page in Chromium under this policy.)"""
    with _client() as client:
        r = client.get("/")
        csp = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
        assert csp["default-src"] == "'none'" and csp["script-src"] == "'self'" and csp["connect-src"] == "'self'"
        assert csp["frame-ancestors"] == "'none'"
        for path in ("/", "/web/app.js", "/web/style.css"):
            assert client.get(path).headers["x-content-type-options"] == "nosniff", path
        # the page holds no inline script that would need 'unsafe-inline' (the config is JSON data)
        scripts = re.findall(r"<script([^>]*)>(.*?)</script>", r.text, re.S)
        assert all('src="/web/' in attrs or ("application/json" in attrs) for attrs, _ in scripts), scripts
        assert " style=" not in r.text and "<style" not in r.text
