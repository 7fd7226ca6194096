"""The pieces of ``--gateway-url`` (core/server/sglang/register.py) that need no gateway: the URL a
worker advertises, the option checks, and a gateway that never answers (the worker goes on)."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from llmkit.core.engine.config import EngineConfig
from llmkit.core.option import OptionError
from llmkit.core.refusals import check_configs
from llmkit.core.server.config import ServerConfig
from llmkit.core.server.sglang import register
from llmkit.core.server.sglang.register import GatewayRegistration, advertised_url, local_url

from server_utils import free_port


def test_advertised_url():
    assert advertised_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert advertised_url("10.0.0.5", 8000) == "http://10.0.0.5:8000"
    assert advertised_url("::1", 8000) == "http://[::1]:8000"
    assert advertised_url("0.0.0.0", 8000, "http://public:9/") == "http://public:9"  # given: as is
    wildcard = advertised_url("0.0.0.0", 8000)  # this machine's address as its name resolves
    assert wildcard == f"http://{socket.gethostbyname(socket.gethostname())}:8000"
    assert local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert local_url("::", 8000) == "http://[::1]:8000"


def _check(**server):
    check_configs(EngineConfig(), ServerConfig(**server))


def test_option_checks():
    _check(gateway_url="http://gw:30000")
    with pytest.raises(OptionError, match="--gateway-url"):
        _check(gateway_url="gw:30000")
    with pytest.raises(OptionError, match="give --gateway-url too"):
        _check(gateway_worker_url="http://w:1")


def test_an_absent_gateway_is_retried_logged_once_and_stops_in_bounded_time(monkeypatch, caplog):
    monkeypatch.setattr(register, "BACKOFF_S", (0.05, 0.1))
    monkeypatch.setattr(register, "SELF_READY_S", 0.0)  # no server of its own here
    nobody = f"http://127.0.0.1:{free_port()}"
    reg = GatewayRegistration(nobody, "http://127.0.0.1:1", nobody, None)
    with caplog.at_level(logging.INFO, logger="llmkit"):
        reg.start()
        time.sleep(1.0)  # several attempts
        t0 = time.monotonic()
        reg.stop()
    assert time.monotonic() - t0 < 10
    assert not reg._thread.is_alive()
    assert sum("cannot register" in r.getMessage() for r in caplog.records) == 1
