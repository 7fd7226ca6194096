"""Where images may come from and what is refused: the media policy against real sockets and files."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import pytest
from PIL import Image

from llmkit.core.multimodal.media import MediaError, MediaPolicy, decode_image, image_bytes


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


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server: /img.png, /big.png (over the cap), a same-host and an other-host redirect."""
    body = png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            port = self.server.server_address[1]
            if self.path == "/img.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == "/same":
                self.send_response(302)
                self.send_header("Location", "/img.png")
                self.end_headers()
            elif self.path == "/other":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}/img.png")
                self.end_headers()
            elif self.path == "/big.png":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"\0" * 5000)
            else:
                self.send_response(404)
                self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_data_url_and_bare_base64_decode():
    raw = png(5, 4)
    im = decode_image(image_bytes(data_url(raw), MediaPolicy()), MediaPolicy())
    assert im.size == (5, 4) and im.mode == "RGB" and im.getpixel((0, 0)) == (200, 10, 10)
    assert image_bytes(base64.b64encode(raw).decode(), MediaPolicy(), bare_base64=True) == raw
    with pytest.raises(MediaError, match="must be data:"):
        image_bytes(base64.b64encode(raw).decode(), MediaPolicy())  # a bare string is not a URL


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
        image_bytes("data:image/png;base64,@@@@", MediaPolicy())
    with pytest.raises(MediaError, match="must be base64"):
        image_bytes("data:image/png,rawbytes", MediaPolicy())


def test_decompression_bomb_is_refused_before_decoding():
    # 4000 x 4000 of one colour compresses to a few KB: the header declares 16 M pixels
    buf = io.BytesIO()
    Image.new("L", (4000, 4000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(MediaError, match="pixels"):
        decode_image(buf.getvalue(), MediaPolicy(max_pixels=1_000_000))


def test_byte_cap():
    with pytest.raises(MediaError, match="larger than"):
        image_bytes(data_url(png(64, 64, (1, 2, 3))), MediaPolicy(max_bytes=50))


def test_urls_are_not_fetched_by_default(image_host):
    with pytest.raises(MediaError, match="--allowed-media-domains"):
        image_bytes(image_host + "/img.png", MediaPolicy())


def test_listed_loopback_literal_is_fetched(image_host):
    policy = MediaPolicy(allowed_domains=("127.0.0.1",))
    assert decode_image(image_bytes(image_host + "/img.png", policy), policy).size == (8, 6)
    assert image_bytes(image_host + "/same", policy) == png()  # a redirect within the host


def test_a_domain_resolving_to_loopback_is_refused(image_host):
    port = image_host.rsplit(":", 1)[1]
    # listed as a domain, but its address is loopback: only the literal itself may be private
    policy = MediaPolicy(allowed_domains=("localhost.localdomain", "127.0.0.1"))
    with pytest.raises(MediaError):
        image_bytes(f"http://localhost.localdomain:{port}/img.png", policy)


def test_redirect_to_another_host_and_oversized_body(image_host):
    policy = MediaPolicy(allowed_domains=("127.0.0.1", "localhost"))
    with pytest.raises(MediaError, match="another host"):
        image_bytes(image_host + "/other", policy)
    with pytest.raises(MediaError, match="larger than"):
        image_bytes(image_host + "/big.png", MediaPolicy(allowed_domains=("127.0.0.1",), max_bytes=1000))


def test_file_urls_only_below_the_allowed_path(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        image_bytes(f"file://{inside}/a.png", MediaPolicy())
    policy = MediaPolicy(allowed_local_path=str(inside))
    assert image_bytes(f"file://{inside}/a.png", policy) == png()
    for escape in (f"file://{inside}/../secret.png", f"file://{inside}/link.png"):
        with pytest.raises(MediaError, match="outside"):
            image_bytes(escape, policy)
