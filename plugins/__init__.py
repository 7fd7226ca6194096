"""llmkit's built-in plugins, registered through the ``llmkit`` entry-point group."""
