"""Structured output: the grammar-backend contract and the cheap limits checked before compiling."""
