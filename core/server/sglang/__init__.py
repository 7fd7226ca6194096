"""SGLang's native routes: ``/generate``, ``/tokenize`` and ``/detokenize``, and the parser routes."""
