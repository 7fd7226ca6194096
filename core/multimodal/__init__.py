"""Images in prompts: what a vision-language model plugin implements (``model.py``), what a
request carries to the engine (``items.py``) and what one forward hands the model (``forward.py``).

The flow: the server fetches and decodes each image (``media``), the model's processor turns it
into an :class:`~llmkit.core.multimodal.items.ImageItem` (pixels, the number of prompt tokens it
fills) and expands the chat template's placeholder into that many tokens. Those tokens carry a
pseudo-id derived from the image's content hash, so the prefix cache keys them by the image: two
requests with the same text and different images never share K/V, the same image re-sent hits.
The engine encodes each image once (cached by hash) and the model takes its rows in place of the
pseudo-ids' embeddings.
"""
