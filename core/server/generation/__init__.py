"""Shared by every API: sampling parameters, grammar constraints, logprobs, and a choice's text
through the reasoning and tool-call parsers."""
