"""``llmkit serve``'s options for images (vision-language models): where they may come from."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.option_table import ServeOption, panel

MEDIA_OPTIONS = panel(
    "Images",
    ServeOption(
        ("--allowed-media-domains",),
        Optional[list[str]],
        None,
        to=lambda names, _: {"server.allowed_media_domains": tuple(names or ())},
        help="A host whose http(s) image URLs are fetched (repeatable; subdomains included). None by "
        "default: images come as data: URLs. Addresses must be public unless the IP or localhost is "
        "listed itself.",
    ),
    ServeOption(
        ("--allowed-local-media-path",),
        Optional[str],
        None,
        to="server",
        help="A directory whose files file: image URLs may name (none by default).",
    ),
    ServeOption(("--max-image-bytes",), int, 20 << 20, to="server", help="The largest encoded image accepted."),
    ServeOption(
        ("--max-image-pixels",),
        int,
        40_000_000,
        to="server",
        help="The most pixels (width x height) an image may declare.",
    ),
    ServeOption(("--max-images-per-request",), int, 16, to="server", help="The most images one request may carry."),
    ServeOption(("--media-fetch-timeout",), float, 10.0, to="server", help="Seconds to fetch one image URL."),
)
