"""Embeddings: encoder models run in batches off the event loop, pooled as sentence-transformers does."""
