"""Images from requests: where they may come from, how big they may be, and their decoding.

- ``data:`` URLs (and bare base64, SGLang's ``image_data``) are always accepted.
- ``http(s)`` URLs only for hosts in ``--allowed-media-domains`` (none by default), fetched by
  ``multimodal.fetch``: on the event loop under one deadline, to an address checked to be public
  (unless the operator listed that very IP literal or ``localhost``), redirects only to the same
  scheme, host and port, the body read up to the byte cap.
- ``file:`` URLs only below ``--allowed-local-media-path`` (resolved, so no ``..`` or symlink
  escapes), and only regular files (a FIFO would block its reader for ever).

Decoding runs in worker threads, never on the event loop, and those threads only decode: a slow
URL never holds one. The header's declared size is checked against the pixel cap before any pixel
is decoded (a decompression bomb is a small file that declares a huge image).
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import io
import os
import stat
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# The pixel cap unless the model keeps more (launch: twice its processor's most): 4096 x 4096
# covers a 4K screenshot and a 12 MP photo, and decodes in about 0.3 s to 64 MB of RGBA.
DEFAULT_MAX_PIXELS = 16 << 20


class MediaError(ValueError):
    """An image the server will not use; the message names the reason."""


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    max_bytes: int = 20 << 20  # an image's encoded size
    max_pixels: int = DEFAULT_MAX_PIXELS  # width x height decoded (a JPEG's drafted size)
    max_images: int = 16  # images in one request
    timeout: float = 10.0  # seconds to fetch one URL


def read_local(url: str, policy: MediaPolicy) -> bytes:
    """A ``file:`` URL's bytes: a regular file below the allowed path (a FIFO, a device or a
    socket there would block a thread or never end). Blocking: run it in a thread."""
    if policy.allowed_local_path is None:
        raise MediaError("file: image URLs are not read by this server (its --allowed-local-media-path)")
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    root = os.path.realpath(policy.allowed_local_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise MediaError("the file: URL is outside the server's --allowed-local-media-path")
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer; O_NOFOLLOW: a link swapped in
        # after realpath is not followed out of the allowed path
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        raise MediaError("the file: URL names no readable file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError("the file: URL names no regular file")
        if st.st_size > policy.max_bytes:
            raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
        with os.fdopen(fd, "rb") as f:
            fd = -1  # the file object closes it
            data = f.read(policy.max_bytes + 1)
    except OSError:
        raise MediaError("the file: URL names no readable file") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > policy.max_bytes:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
    return data


def _b64(data: str, policy: MediaPolicy) -> bytes:
    if len(data) > policy.max_bytes * 4 // 3 + 4:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
    try:
        return base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the image's base64 data is not valid base64") from None


def is_inline(source: str, bare_base64: bool = False) -> bool:
    """Whether the image is in the request itself (a ``data:`` URL, or bare base64): nothing to fetch."""
    return source.startswith("data:") or (bare_base64 and url_scheme(source) not in ("http", "https", "file"))


def url_scheme(source: str) -> str:
    return source.split(":", 1)[0].lower() if ":" in source[:8] else ""


def inline_bytes(source: str, policy: MediaPolicy, bare_base64: bool = False) -> bytes:
    """The encoded image of a ``data:`` URL (or, with ``bare_base64``, raw base64)."""
    if source.startswith("data:"):
        head, sep, data = source.partition(",")
        if not sep or ";base64" not in head:
            raise MediaError("a data: image URL must be base64 (data:image/png;base64,...)")
        return _b64(data, policy)
    if bare_base64:
        return _b64(source, policy)
    raise MediaError("image URLs must be data:, http(s): or file: URLs")


def decode_image(
    data: bytes, policy: MediaPolicy, target_size: Callable[[int, int], tuple[int, int] | None] | None = None
):
    """An RGB ``PIL.Image`` from encoded bytes, within the pixel cap.

    ``target_size(width, height)`` is the size the model's processor will resize the image to. The
    image is brought down toward twice that size, never below: a JPEG decoded at 1/2, 1/4 or 1/8
    scale (``draft``), any image reduced by whole factors (box averages) before converting, so the
    processor never sees, nor copies to floats, a full-size camera image."""
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
            want = target_size(w, h) if target_size is not None and w > 0 and h > 0 else None
            if want:  # keep twice the size: the processor's resize from there is as from the whole
                want = (2 * want[0], 2 * want[1])  # image (PIL's thumbnail uses this reducing_gap)
            if im.format == "JPEG" and want:
                im.draft("RGB", want)  # the header's size becomes the scaled one: that is what is decoded
            dw, dh = im.size
            if w <= 0 or h <= 0 or dw * dh > policy.max_pixels:
                raise MediaError(f"the image is {w}x{h}: more than {policy.max_pixels} pixels (--max-image-pixels)")
            im.seek(0)  # an animation's first frame
            im.load()
            out = _reduced(im, want)
            im.close()  # the full-size pixels: leaving the block alone keeps them until we return
        if dw * dh >= TRIM_PIXELS:
            release_memory()
        return out
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError("the data is not an image in a supported format") from None
    except Image.DecompressionBombError:
        raise MediaError(f"the image declares more than {policy.max_pixels} pixels") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise MediaError(f"the image is corrupt or truncated ({type(exc).__name__})") from None


def _reduced(im, want: tuple[int, int] | None):
    """``im`` (loaded) as a new RGB image, reduced by whole factors toward ``want`` (never below
    it) before any conversion that would copy it at full size; transparency over white, as a
    viewer shows it."""
    from PIL import Image

    src = im
    transparent = im.mode in ("RGBA", "LA", "P", "PA")
    if want:
        factor = (max(1, im.width // max(1, want[0])), max(1, im.height // max(1, want[1])))
        if factor != (1, 1):
            if im.mode not in ("L", "LA", "RGB", "RGBA", "I", "F", "CMYK"):  # reduce takes these
                im = im.convert("RGBA" if transparent else "RGB")
            im = im.reduce(factor)
    if transparent:
        rgba = im.convert("RGBA") if im.mode != "RGBA" else im
        im = Image.new("RGB", rgba.size, (255, 255, 255))
        im.paste(rgba, mask=rgba.getchannel("A"))
    elif im.mode != "RGB":
        im = im.convert("RGB")
    return im.copy() if im is src else im


# From this many decoded pixels (12 MB of RGB) the freed buffers are handed back to the system:
# glibc keeps the freed memory of the worker threads' arenas, so a few large decodes otherwise
# leave hundreds of MB resident for good (14 of 4000 x 4000 on 4 threads: 184 MB). A trim of a
# small heap takes microseconds.
TRIM_PIXELS = 4 << 20


def release_memory() -> None:
    """Hands freed heap memory back to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
