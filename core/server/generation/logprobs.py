"""Logprob formatting for chat (``content`` entries) and completions (parallel arrays)."""

from __future__ import annotations

from llmkit.core.engine.messages import TokenLogprob
from llmkit.core.server.errors import APIError


def check_prompt_logprobs(state, reqs, param: str) -> None:
    """Each prompt token's logprobs cost a softmax over the whole vocabulary (2,000 tokens took
    6.7 s): a request may ask for them over at most --max-prompt-logprobs-tokens tokens."""
    n = sum(len(r.prompt_ids) for r in reqs if r.return_prompt_logprobs)
    cap = state.options.max_prompt_logprobs_tokens
    if n > cap:
        raise APIError(
            f"prompt logprobs were asked for over {n} prompt tokens, more than the limit of {cap} "
            "(--max-prompt-logprobs-tokens)",
            param=param,
        )


def _text(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> list[dict]:
    out = []
    for lp in lps:
        tok = _text(tokenizer, lp.token_id)
        out.append(
            {
                "token": tok,
                "bytes": list(tok.encode("utf-8", "replace")),
                "logprob": lp.logprob,
                "top_logprobs": [
                    {"token": (t := _text(tokenizer, tid)), "bytes": list(t.encode("utf-8", "replace")), "logprob": v}
                    for tid, v in lp.top
                ],
            }
        )
    return out


class CompletionLogprobs:
    """Accumulates the completions-style logprobs object, with real text offsets."""

    def __init__(self, tokenizer, offset: int = 0) -> None:
        self.tok = tokenizer
        self.offset = offset
        self.data = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, token_id: int, lp: TokenLogprob | None) -> None:
        text = _text(self.tok, token_id)
        d = self.data
        d["tokens"].append(text)
        d["token_logprobs"].append(None if lp is None else lp.logprob)
        top = None
        if lp is not None:
            top = {}
            for tid, v in lp.top:  # identical strings collapse; the best rank is kept
                top.setdefault(_text(self.tok, tid), v)
            # The sampled token is always listed, so logprobs=0 still gives its entry (OpenAI's
            # reference and vLLM do the same).
            top.setdefault(text, lp.logprob)
        d["top_logprobs"].append(top)
        d["text_offset"].append(self.offset)
        self.offset += len(text)

    def take(self) -> dict:
        out = self.data
        self.data = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return out
