"""Placeholder while this plugin is written; registers nothing yet."""
