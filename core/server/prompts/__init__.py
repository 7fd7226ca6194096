"""From a request's messages or text to prompt token ids: the chat template, tool prompts, size checks."""
