"""Speech models (Whisper) served beside the generation engine: audio windows in, text out."""
