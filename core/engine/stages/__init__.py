"""The stages of building an engine that :mod:`llmkit.core.engine.builder` runs in order."""
