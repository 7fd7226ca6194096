"""Output parsing: the reasoning-parser and tool-call-parser contracts, and linear-time text scanning."""
