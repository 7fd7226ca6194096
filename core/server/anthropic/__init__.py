"""Anthropic's Messages API (``/v1/messages``), served by the chat run."""
