"""llmkit core: interfaces and the engine. Never imports a plugin module."""
