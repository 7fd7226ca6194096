"""Audio from requests: decoding uploads to mono float samples at the model's rate, and the log-mel
features speech models read."""
