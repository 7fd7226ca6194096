"""The llmkit command line."""
