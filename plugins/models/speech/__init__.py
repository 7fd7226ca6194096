"""Speech-to-text models: audio features in, text tokens out (served behind /v1/audio/*)."""
