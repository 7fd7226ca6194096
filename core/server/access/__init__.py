"""Who may call the server and see what: API keys, the owner of stored objects, rate limits."""
