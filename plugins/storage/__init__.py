"""Batch and file storage backends."""
