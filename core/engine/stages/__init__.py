"""The stages of building an engine that :mod:`llmkit.core.engine.builder` runs in order, and the
ones that follow once it is built: every process's :mod:`.startup_gc`, and the engine's
:mod:`.warmup` through its captured paths before it serves."""
