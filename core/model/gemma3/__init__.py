"""Gemma 3's text stack and the parts its image-text model adds, shared by its two plugins."""
