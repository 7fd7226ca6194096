"""Speculative decoding: a proposer guesses the next tokens of a running request, one target
forward scores them all, and the longest prefix the target itself would have produced is kept
(plus the target's own next token). Proposers are plugins (``--speculative-algorithm``)."""
