"""The stages of building an engine that :mod:`llmkit.core.engine.builder` runs in order, and the
one every process runs once it is built (:mod:`.startup_gc`)."""
