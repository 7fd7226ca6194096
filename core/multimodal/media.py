"""Images from requests: where they may come from, how big they may be, and their decoding.

- ``data:`` URLs (and bare base64, SGLang's ``image_data``) are always accepted.
- ``http(s)`` URLs only for hosts in ``--allowed-media-domains`` (none by default). A host's
  addresses must be public unless the operator listed that very IP literal or ``localhost``: a
  listed domain whose DNS answers with a private or loopback address (rebinding, a typo's
  squatter) is refused. Redirects are followed only within the same host, the body is read up to
  the byte cap, under one timeout.
- ``file:`` URLs only below ``--allowed-local-media-path`` (resolved, so no ``..`` or symlink
  escapes).

Decoding runs in worker threads, never on the event loop. The header's declared size is checked
against the pixel cap before any pixel is decoded (a decompression bomb is a small file that
declares a huge image).
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import socket
import urllib.parse
from dataclasses import dataclass

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class MediaError(ValueError):
    """An image the server will not use; the message names the reason."""


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    max_bytes: int = 20 << 20  # an image's encoded size
    max_pixels: int = 40_000_000  # width x height as its header declares it
    max_images: int = 16  # images in one request
    timeout: float = 10.0  # seconds to fetch one URL


def _host_allowed(host: str, policy: MediaPolicy) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (x.lower().strip(".") for x in policy.allowed_domains))


def _check_addresses(host: str, port: int, policy: MediaPolicy) -> None:
    literal = host.lower() in {d.lower() for d in policy.allowed_domains}
    try:
        ipaddress.ip_address(host)
        is_ip = True
    except ValueError:
        is_ip = False
    if (is_ip or host.lower() == "localhost") and literal:
        return  # the operator named this address itself
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MediaError(f"the image URL's host '{host}' does not resolve ({exc.strerror or exc})") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0].split("%")[0])
        if not addr.is_global:
            raise MediaError(f"the image URL's host '{host}' resolves to a non-public address ({addr})")


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    import httpx

    for _ in range(4):  # the URL and up to three same-host redirects
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        if parts.scheme not in ("http", "https") or not host:
            raise MediaError("image URLs must be data:, http(s): or file: URLs")
        if not _host_allowed(host, policy):
            raise MediaError(
                f"fetching images from '{host}' is not allowed (the server's --allowed-media-domains)"
                if policy.allowed_domains
                else "image URLs are not fetched by this server (start it with --allowed-media-domains); "
                "send the image as a data: URL"
            )
        _check_addresses(host, parts.port or (443 if parts.scheme == "https" else 80), policy)
        try:
            with httpx.stream("GET", url, timeout=policy.timeout, follow_redirects=False) as resp:
                if resp.is_redirect:
                    nxt = urllib.parse.urljoin(url, resp.headers.get("location", ""))
                    if urllib.parse.urlsplit(nxt).hostname != host:
                        raise MediaError("the image URL redirects to another host")
                    url = nxt
                    continue
                if resp.status_code != 200:
                    raise MediaError(f"fetching the image URL answered HTTP {resp.status_code}")
                declared = resp.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > policy.max_bytes:
                    raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
                data = bytearray()
                for chunk in resp.iter_bytes():
                    data += chunk
                    if len(data) > policy.max_bytes:
                        raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
                return bytes(data)
        except httpx.TimeoutException:
            raise MediaError(f"fetching the image URL took longer than {policy.timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise MediaError(f"fetching the image URL failed: {type(exc).__name__}") from None
    raise MediaError("the image URL redirects too many times")


def _read_local(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError("file: image URLs are not read by this server (its --allowed-local-media-path)")
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    root = os.path.realpath(policy.allowed_local_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise MediaError("the file: URL is outside the server's --allowed-local-media-path")
    try:
        size = os.path.getsize(real)
        if size > policy.max_bytes:
            raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
        with open(real, "rb") as f:
            return f.read(policy.max_bytes + 1)
    except OSError:
        raise MediaError("the file: URL names no readable file") from None


def _b64(data: str, policy: MediaPolicy) -> bytes:
    if len(data) > policy.max_bytes * 4 // 3 + 4:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
    try:
        return base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the image's base64 data is not valid base64") from None


def image_bytes(source: str, policy: MediaPolicy, bare_base64: bool = False) -> bytes:
    """The encoded image a request's URL (or, with ``bare_base64``, raw base64) names."""
    if source.startswith("data:"):
        head, sep, data = source.partition(",")
        if not sep or ";base64" not in head:
            raise MediaError("a data: image URL must be base64 (data:image/png;base64,...)")
        return _b64(data, policy)
    scheme = source.split(":", 1)[0].lower() if ":" in source[:8] else ""
    if scheme in ("http", "https"):
        return _fetch(source, policy)
    if scheme == "file":
        return _read_local(source, policy)
    if bare_base64:
        return _b64(source, policy)
    raise MediaError("image URLs must be data:, http(s): or file: URLs")


def decode_image(data: bytes, policy: MediaPolicy):
    """An RGB ``PIL.Image`` from encoded bytes, within the pixel cap."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_bytes:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
    if not data:
        raise MediaError("the image is empty")
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in FORMATS:
                raise MediaError(f"image format {im.format} is not supported ({', '.join(FORMATS)})")
            w, h = im.size
            if w <= 0 or h <= 0 or w * h > policy.max_pixels:
                raise MediaError(f"the image is {w}x{h}: more than {policy.max_pixels} pixels")
            im.seek(0)  # an animation's first frame
            im.load()
            if im.mode in ("RGBA", "LA", "P", "PA"):  # transparency over white, as a viewer shows it
                rgba = im.convert("RGBA")
                out = Image.new("RGB", rgba.size, (255, 255, 255))
                out.paste(rgba, mask=rgba.getchannel("A"))
                return out
            return im.convert("RGB")
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError("the data is not an image in a supported format") from None
    except Image.DecompressionBombError:
        raise MediaError(f"the image declares more than {policy.max_pixels} pixels") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise MediaError(f"the image is corrupt or truncated ({type(exc).__name__})") from None
