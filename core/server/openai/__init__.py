"""OpenAI's chat completions and completions; the chat run other APIs are served by."""
