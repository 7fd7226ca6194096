"""Test kits for plugin authors: the checks llmkit's own plugins pass, to run in a plugin's test suite.

* :mod:`llmkit.testing.storage`: :class:`~llmkit.testing.storage.StorageContract` and
  :class:`~llmkit.testing.storage.LeaseContract`, for a storage backend;
* :mod:`llmkit.testing.attention`: :class:`~llmkit.testing.attention.AttentionBackendContract` and
  :func:`~llmkit.testing.attention.check_against_reference`, an attention backend against the
  reference one (``torch``, looked up in the plugin registry) on prefill, decode and mixed batches.

These modules import pytest and are meant for test suites only: pytest is not a dependency of
llmkit (install it with ``pip install 'llmkit[test]'`` or on its own), and nothing in llmkit's
runtime (``llmkit.core``, ``llmkit.plugins``, ``llmkit.cli``) imports ``llmkit.testing``.
"""
