"""A speculative algorithm that always guesses the request's last token again: right on
repetitive text, wrong elsewhere, and never able to change the output (the target verifies)."""

from llmkit.core import Proposer


class RepeatLast(Proposer):
    def propose(self, req, max_tokens: int) -> list[int]:
        return [req.all_ids[-1]] * max_tokens
