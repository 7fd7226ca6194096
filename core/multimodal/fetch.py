"""An image's bytes; URLs fetched on the event loop, under one deadline, from the address that was checked.

- One deadline (``--media-fetch-timeout``) for the whole fetch: resolving, connecting, every
  redirect and every byte of the body. A server that drips a byte a second is cut off at the
  deadline, not at each read's timeout.
- The fetch is a coroutine, so a slow URL holds no thread: the media threads only decode, and a
  request whose images are data: URLs never waits behind other requests' fetches.
- The host is resolved once, its addresses checked, and the connection made to a checked address
  (the URL's host still goes in the ``Host`` header and the TLS SNI, and the certificate is checked
  against it): a second lookup cannot answer with another address (DNS rebinding).
- Redirects are followed only to the same scheme, host and port.
- Proxy variables and ``.netrc`` do not apply (``trust_env=False``): an image fetch goes straight
  to the host the policy allowed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.parse

from llmkit.core.multimodal.media import MediaError, MediaPolicy, inline_bytes, is_inline, read_local, url_scheme

MAX_REDIRECTS = 3


async def image_bytes(source: str, policy: MediaPolicy, bare_base64: bool = False) -> bytes:
    """The encoded image a request's URL (or, with ``bare_base64``, raw base64) names. URLs are
    fetched on the event loop, files read in a thread."""
    if is_inline(source, bare_base64):
        return inline_bytes(source, policy, bare_base64)
    kind = url_scheme(source)
    if kind in ("http", "https"):
        return await fetch_url(source, policy)
    if kind == "file":
        return await asyncio.to_thread(read_local, source, policy)
    raise MediaError("image URLs must be data:, http(s): or file: URLs")


def _host_allowed(host: str, policy: MediaPolicy) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (x.lower().strip(".") for x in policy.allowed_domains))


def _origin(parts: urllib.parse.SplitResult) -> tuple[str, str, int]:
    scheme = parts.scheme.lower()
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:  # not a number, or out of range
        raise MediaError("the image URL's port is not valid") from None
    return scheme, (parts.hostname or "").rstrip("."), port


async def _addresses(host: str, port: int, policy: MediaPolicy) -> list[str]:
    """The addresses to connect to, each checked: public, unless the operator listed this very IP
    literal or ``localhost``."""
    listed = host in {d.lower().rstrip(".") for d in policy.allowed_domains}
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        return await _resolve(host, port, local_ok=listed and host == "localhost")
    if not (_public(literal) or listed):
        raise MediaError(f"the image URL's address {literal} is not public")
    return [str(literal)]


async def _resolve(host: str, port: int, local_ok: bool) -> list[str]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MediaError(f"the image URL's host '{host}' does not resolve ({exc.strerror or exc})") from None
    out: list[str] = []
    for info in infos:
        addr = ipaddress.ip_address(info[4][0].split("%")[0])
        if not (_public(addr) or local_ok):
            raise MediaError(f"the image URL's host '{host}' resolves to a non-public address ({addr})")
        if str(addr) not in out:
            out.append(str(addr))
    if not out:
        raise MediaError(f"the image URL's host '{host}' does not resolve")
    return out


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _public(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Global, judged by the IPv4 address inside an IPv6 one that carries one: ``2002::/16``
    (6to4) and ``64:ff9b::/96`` (NAT64) count as global themselves, yet ``64:ff9b::a9fe:a9fe``
    reaches 169.254.169.254 through a NAT64 gateway."""
    if isinstance(addr, ipaddress.IPv6Address):
        inner = addr.ipv4_mapped or addr.sixtofour
        if inner is None and addr in _NAT64:
            inner = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
        if inner is not None:
            return inner.is_global
    return addr.is_global


def _check_url(url: str, policy: MediaPolicy) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise MediaError("image URLs must be data:, http(s): or file: URLs")
    if not _host_allowed(parts.hostname, policy):
        raise MediaError(
            f"fetching images from '{parts.hostname}' is not allowed (the server's --allowed-media-domains)"
            if policy.allowed_domains
            else "image URLs are not fetched by this server (start it with --allowed-media-domains); "
            "send the image as a data: URL"
        )
    return parts


async def fetch_url(url: str, policy: MediaPolicy) -> bytes:
    """The body of an allowed http(s) image URL, within the byte cap and the fetch deadline."""
    import httpx

    try:
        return await asyncio.wait_for(_fetch(url, policy), policy.timeout)
    except asyncio.TimeoutError:  # TimeoutError itself from 3.11
        raise MediaError(f"fetching the image URL took longer than {policy.timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise MediaError(f"fetching the image URL failed: {type(exc).__name__}") from None


async def _fetch(url: str, policy: MediaPolicy) -> bytes:
    import httpx

    parts = _check_url(url, policy)
    origin = _origin(parts)
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=None) as client:
        for _ in range(MAX_REDIRECTS + 1):
            body, location = await _get(client, url, parts, policy)
            if location is None:
                return body
            url = urllib.parse.urljoin(url, location)
            parts = urllib.parse.urlsplit(url)
            if _origin(parts) != origin:
                raise MediaError("the image URL redirects to another host, port or scheme")
    raise MediaError("the image URL redirects too many times")


async def _get(client, url: str, parts: urllib.parse.SplitResult, policy: MediaPolicy) -> tuple[bytes, str | None]:
    """One GET, to the first checked address that accepts a connection: ``(body, None)``, or
    ``(b"", location)`` for a redirect."""
    import httpx

    port = _origin(parts)[2]
    target = httpx.URL(url)
    name = target.raw_host.decode("ascii").rstrip(".")  # IDNA-encoded, as DNS, Host and SNI want it
    addresses = await _addresses(name, port, policy)
    for i, addr in enumerate(addresses):
        request = client.build_request(
            "GET",
            target.copy_with(host=addr),
            headers={"Host": target.netloc.decode("ascii")},  # the name (and port), not the address
            extensions={"sni_hostname": name},
        )
        try:
            resp = await client.send(request, stream=True)
        except httpx.ConnectError:
            if i == len(addresses) - 1:
                raise
            continue
        try:
            return await _read(resp, policy)
        finally:
            await resp.aclose()
    raise AssertionError("unreachable")


async def _read(resp, policy: MediaPolicy) -> tuple[bytes, str | None]:
    if resp.is_redirect:
        return b"", resp.headers.get("location", "")
    if resp.status_code != 200:
        raise MediaError(f"fetching the image URL answered HTTP {resp.status_code}")
    declared = resp.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > policy.max_bytes:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
    data = bytearray()
    async for chunk in resp.aiter_bytes():
        data += chunk
        if len(data) > policy.max_bytes:
            raise MediaError(f"the image is larger than {policy.max_bytes} bytes")
    return bytes(data), None
