"""``llmkit serve``'s option table, one module a theme (and one ``--help`` panel each)."""
