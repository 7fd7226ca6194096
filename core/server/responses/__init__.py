"""The OpenAI Responses API (``/v1/responses``), served by the chat machinery."""
