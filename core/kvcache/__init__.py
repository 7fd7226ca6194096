"""KV memory, testable on the CPU without a model: the paged pool of K/V tensors and its page
allocator (``kv_pool``), and prefix management apart from it (``prefix_cache``: the contract and
the no-op; ``radix_cache``: SGLang's radix tree over token ids), and the storage tier below it
(``storage_tier``, over a ``kv_storage`` backend; ``tier_keys`` and ``tier_entry``: what an
entry is called and holds)."""
