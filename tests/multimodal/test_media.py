"""Where images may come from and what is refused: the media policy against real sockets and files."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time

import pytest
from image_hosts import ImageHost
from PIL import Image

from llmkit.core.multimodal.fetch import image_bytes
from llmkit.core.multimodal.media import MediaError, MediaPolicy, decode_image


def png(w=8, h=6, color=(200, 10, 10), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def _noisy_png() -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (32, 32), bytes((i * 7919) % 251 for i in range(32 * 32 * 3))).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def get(source: str, policy: MediaPolicy, bare_base64: bool = False) -> bytes:
    return asyncio.run(image_bytes(source, policy, bare_base64))


@pytest.fixture(scope="module")
def hosts():
    """Two image hosts on loopback: the second is another port of the same host."""
    first, second = ImageHost(png(), drip_interval=0.5), ImageHost(png())
    first.other_port = second.port
    yield first, second
    first.close()
    second.close()


@pytest.fixture
def image_host(hosts):
    return hosts[0].url


def test_data_url_and_bare_base64_decode():
    raw = png(5, 4)
    im = decode_image(get(data_url(raw), MediaPolicy()), MediaPolicy())
    assert im.size == (5, 4) and im.mode == "RGB" and im.getpixel((0, 0)) == (200, 10, 10)
    assert get(base64.b64encode(raw).decode(), MediaPolicy(), bare_base64=True) == raw
    with pytest.raises(MediaError, match="must be data:"):
        get(base64.b64encode(raw).decode(), MediaPolicy())  # a bare string is not a URL


def test_transparency_is_composited_on_white():
    im = decode_image(png(2, 2, (0, 0, 0, 0), mode="RGBA"), MediaPolicy())
    assert im.mode == "RGB" and im.getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"", "empty"),
        (b"not an image at all", "not an image"),
        (_noisy_png()[:300], "corrupt or truncated"),
    ],
)
def test_bad_images_are_refused(raw, match):
    with pytest.raises(MediaError, match=match):
        decode_image(raw, MediaPolicy())


def test_bad_base64_and_non_base64_data_urls():
    with pytest.raises(MediaError, match="not valid base64"):
        get("data:image/png;base64,@@@@", MediaPolicy())
    with pytest.raises(MediaError, match="must be base64"):
        get("data:image/png,rawbytes", MediaPolicy())


def test_decompression_bomb_is_refused_before_decoding():
    # 4000 x 4000 of one colour compresses to a few KB: the header declares 16 M pixels
    buf = io.BytesIO()
    Image.new("L", (4000, 4000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(MediaError, match="pixels"):
        decode_image(buf.getvalue(), MediaPolicy(max_pixels=1_000_000))


def test_byte_cap():
    with pytest.raises(MediaError, match="larger than"):
        get(data_url(png(64, 64, (1, 2, 3))), MediaPolicy(max_bytes=50))


def test_urls_are_not_fetched_by_default(image_host):
    with pytest.raises(MediaError, match="--allowed-media-domains"):
        get(image_host + "/img.png", MediaPolicy())


def test_listed_loopback_literal_is_fetched(image_host):
    policy = MediaPolicy(allowed_domains=("127.0.0.1",))
    assert decode_image(get(image_host + "/img.png", policy), policy).size == (8, 6)
    assert get(image_host + "/same", policy) == png()  # a redirect within the host


def test_a_domain_resolving_to_loopback_is_refused(image_host):
    port = image_host.rsplit(":", 1)[1]
    # listed as a domain, but its address is loopback: only the literal itself may be private
    policy = MediaPolicy(allowed_domains=("localhost.localdomain", "127.0.0.1"))
    with pytest.raises(MediaError):
        get(f"http://localhost.localdomain:{port}/img.png", policy)


def test_redirect_to_another_host_and_oversized_body(image_host):
    policy = MediaPolicy(allowed_domains=("127.0.0.1", "localhost"))
    with pytest.raises(MediaError, match="another host"):
        get(image_host + "/other", policy)
    with pytest.raises(MediaError, match="larger than"):
        get(image_host + "/big.png", MediaPolicy(allowed_domains=("127.0.0.1",), max_bytes=1000))


def test_file_urls_only_below_the_allowed_path(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        get(f"file://{inside}/a.png", MediaPolicy())
    policy = MediaPolicy(allowed_local_path=str(inside))
    assert get(f"file://{inside}/a.png", policy) == png()
    for escape in (f"file://{inside}/../secret.png", f"file://{inside}/link.png"):
        with pytest.raises(MediaError, match="outside"):
            get(escape, policy)


# --- issue 52: the fetch deadline, file kinds, redirects, the checked address, proxies ---------


def test_the_fetch_timeout_bounds_the_whole_fetch(image_host):
    """A body dripping a byte every 0.5 s never trips a per-read timeout of 1 s; the deadline is
    for the whole fetch."""
    timeout = 1.0
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), timeout=timeout)
    start = time.monotonic()
    with pytest.raises(MediaError, match="longer than 1 s"):
        get(image_host + "/drip.png", policy)
    assert (time.monotonic() - start) / timeout < 2.5


def test_a_fifo_under_the_allowed_path_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")  # no writer: opening it for reading would wait for ever
    policy = MediaPolicy(allowed_local_path=str(tmp_path))
    start = time.monotonic()
    with pytest.raises(MediaError, match="no regular file"):
        get(f"file://{tmp_path}/pipe.png", policy)
    assert time.monotonic() - start < 5
    with pytest.raises(MediaError, match="no regular file"):
        get(f"file://{tmp_path}", policy)  # a directory


def test_a_redirect_to_another_port_of_the_host_is_refused(image_host):
    policy = MediaPolicy(allowed_domains=("127.0.0.1",))
    with pytest.raises(MediaError, match="another host, port or scheme"):
        get(image_host + "/port", policy)


def test_proxy_variables_do_not_apply(image_host, monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: nothing listens
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert get(image_host + "/img.png", MediaPolicy(allowed_domains=("127.0.0.1",))) == png()


def resolve_as(monkeypatch, name: str, answers: list[str]) -> list[str]:
    """``name`` resolves to ``answers[0]``, the next lookup to ``answers[1]``, and so on (the last
    repeats); its addresses count as public: loopback stands in for a public host here. Returns
    the answers not given yet."""
    import ipaddress
    import socket

    real = socket.getaddrinfo

    def getaddrinfo(host, port, *a, **kw):
        if host != name:
            return real(host, port, *a, **kw)
        addr = answers.pop(0) if len(answers) > 1 else answers[0]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (addr, port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(ipaddress.IPv4Address, "is_global", property(lambda self: True))
    return answers


def test_the_connection_goes_to_the_address_that_was_checked(hosts, monkeypatch):
    """DNS rebinding: the name answers an allowed address to the check and another one to a
    second lookup. Only one lookup is made, and the connection goes to the checked address with
    the name in the Host header."""
    host = hosts[0]
    left = resolve_as(monkeypatch, "images.test", ["127.0.0.1", "127.0.0.3"])  # nothing listens on .3
    url = f"http://images.test:{host.port}/img.png"
    assert get(url, MediaPolicy(allowed_domains=("images.test",))) == png()
    assert host.hosts[-1] == f"images.test:{host.port}"
    assert left == ["127.0.0.3"]  # one lookup


def test_https_to_the_checked_address_keeps_the_name_for_sni_and_the_certificate(monkeypatch, tmp_path):
    """Connecting to an address, not the name: TLS still sends the name (SNI) and checks the
    certificate against it, so a certificate for the name is accepted and one for another is not."""
    import datetime
    import http.server
    import ssl
    import threading

    import httpx

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "images.test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("images.test")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(pem)
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    sni: list[str | None] = []
    server_ctx.sni_callback = lambda sock, server_name, ctx: sni.append(server_name)
    body = png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.socket = server_ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    trusting = ssl.create_default_context(cadata=pem.decode())

    class Client(httpx.AsyncClient):  # the image fetch, trusting this test's certificate
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "verify": trusting})

    monkeypatch.setattr(httpx, "AsyncClient", Client)
    port = srv.server_address[1]
    try:
        resolve_as(monkeypatch, "images.test", ["127.0.0.1"])
        policy = MediaPolicy(allowed_domains=("images.test", "other.test"), timeout=5)
        assert get(f"https://images.test:{port}/img.png", policy) == body
        assert sni == ["images.test"]
        resolve_as(monkeypatch, "other.test", ["127.0.0.1"])  # the same server, another name
        with pytest.raises(MediaError, match="ConnectError"):  # its certificate is not for it
            get(f"https://other.test:{port}/img.png", policy)
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_png_over_the_pixel_cap_is_refused_before_decoding():
    buf = io.BytesIO()
    Image.new("RGB", (6300, 6300), (9, 9, 9)).save(buf, format="PNG")
    assert len(buf.getvalue()) < 200_000
    start = time.monotonic()
    with pytest.raises(MediaError, match="6300x6300: more than"):
        decode_image(buf.getvalue(), MediaPolicy())  # the default cap: 16 Mi pixels
    assert time.monotonic() - start < 1


def test_large_images_decode_at_the_size_the_model_uses():
    """A JPEG decodes at a reduced scale (draft); any image is reduced by whole factors before it
    is converted; neither below twice the processor's size (what its resize needs to be as good as
    from the whole image)."""
    want = lambda w, h: (224, 224)  # noqa: E731
    buf = io.BytesIO()
    Image.new("RGB", (4000, 3000), (200, 10, 10)).save(buf, format="JPEG")
    im = decode_image(buf.getvalue(), MediaPolicy(), want)
    assert im.mode == "RGB" and im.size == (1000 // 2, 750)  # drafted to 1/4, then reduced (2, 1)
    buf = io.BytesIO()
    Image.new("P", (4000, 3000)).save(buf, format="PNG")
    im = decode_image(buf.getvalue(), MediaPolicy(), want)
    assert im.mode == "RGB" and im.size == (4000 // 8, 3000 // 6)
    # the JPEG's cap is on what is decoded: 48 M pixels declared, 1/8 of each side drafted
    buf = io.BytesIO()
    Image.new("L", (8000, 6000)).save(buf, format="JPEG")
    assert decode_image(buf.getvalue(), MediaPolicy(max_pixels=1_000_000), want).size == (1000 // 2, 750)
    with pytest.raises(MediaError, match="pixels"):
        decode_image(buf.getvalue(), MediaPolicy(max_pixels=1_000_000))  # no target: full size


def test_the_default_pixel_cap_follows_the_model():
    import dataclasses
    import types

    from llmkit.core.launch import media_policy
    from llmkit.core.server.config import ServerConfig

    qwen = types.SimpleNamespace(max_pixels=12_845_056)  # Qwen2.5-VL's processor
    assert media_policy(ServerConfig()).max_pixels == 16 << 20  # a text model, or one that keeps less
    assert media_policy(ServerConfig(), qwen).max_pixels == 2 * 12_845_056
    assert media_policy(dataclasses.replace(ServerConfig(), max_image_pixels=5), qwen).max_pixels == 5


def test_ipv6_addresses_are_judged_by_the_ipv4_address_they_carry():
    import ipaddress

    from llmkit.core.multimodal.fetch import _public

    for inside in ("64:ff9b::a9fe:a9fe", "2002:7f00:1::", "::ffff:10.0.0.1"):  # NAT64, 6to4, mapped
        assert not _public(ipaddress.ip_address(inside)), inside
    for public in ("64:ff9b::808:808", "2002:808:808::", "2606:4700::1111", "8.8.8.8"):
        assert _public(ipaddress.ip_address(public)), public
