"""Request validation shared by every generating route: field ranges, token ids, context length.

Every check raises :class:`APIError` (400) with the offending ``param``, before anything reaches
the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from llmkit.core.engine.messages import SamplingParams
from llmkit.core.server.errors import APIError
from llmkit.core.server.generation.length_limit import max_new_tokens
from llmkit.core.server.generation.sampling_defaults import FIELDS, resolve

MAX_N = 16
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20


def _finite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise APIError(f"{name} must be a finite number", param=name)


def build_sampling_params(
    req,
    *,
    prompt_len: int,
    max_context: int,
    vocab_size: int,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    defaults: Mapping[str, float | int] | None,
    max_tokens_param: str = "max_tokens",
    prompt_param: str = "messages",
) -> SamplingParams:
    """The engine's sampling parameters for ``req`` (a request model of any route, read by
    attribute), every field checked. The sampling fields it left out take ``defaults`` (the
    server's, from the generation config: ``sampling_defaults.resolve``); the number of tokens to
    generate is ``length_limit.max_new_tokens``' decision."""
    eff = resolve(req, defaults)
    temperature, top_p, top_k, min_p, rep = (eff[k] for k in FIELDS)
    for name, v in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("min_p", min_p),
        ("frequency_penalty", req.frequency_penalty),
        ("presence_penalty", req.presence_penalty),
        ("repetition_penalty", rep),
    ):
        _finite(name, v)
    if temperature < 0:
        raise APIError("temperature must be a non-negative finite number", param="temperature")
    if not 0 < top_p <= 1:
        raise APIError("top_p must be in (0, 1]", param="top_p")
    if top_k != -1 and top_k < 1:
        raise APIError("top_k must be -1 (disable) or at least 1", param="top_k")
    if not 0 <= min_p <= 1:
        raise APIError("min_p must be in [0, 1]", param="min_p")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2 <= getattr(req, name) <= 2:
            raise APIError(f"{name} must be in [-2, 2]", param=name)
    if not 0 < rep <= 2:
        raise APIError("repetition_penalty must be in (0, 2]", param="repetition_penalty")
    if not 1 <= req.n <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N}", param="n")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")

    max_new = max_new_tokens(prompt_len, max_tokens, max_context, param=max_tokens_param, prompt_param=prompt_param)
    if not 0 <= req.min_tokens <= max_new:
        raise APIError("min_tokens must be in [0, max_tokens]", param="min_tokens")

    stop = req.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise APIError(f"at most {MAX_STOP} stop sequences are allowed", param="stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise APIError(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters", param="stop")

    bias = None
    if req.logit_bias:
        bad, bias = [], {}
        for k, v in req.logit_bias.items():
            try:
                tid = int(k)
            except ValueError:
                bad.append(k)
                continue
            if not 0 <= tid < vocab_size or not math.isfinite(v) or not -100 <= v <= 100:
                bad.append(k)
                continue
            bias[tid] = float(v)
        if bad:
            raise APIError(
                f"logit_bias has invalid entries {bad}: keys must be token ids in "
                f"[0, {vocab_size - 1}] and biases in [-100, 100]",
                param="logit_bias",
            )

    stop_regex = _stop_regexes(req)

    stop_ids = tuple(req.stop_token_ids or ())
    bad_ids = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise APIError(f"stop_token_ids {bad_ids} are out of vocabulary (size {vocab_size})", param="stop_token_ids")

    seed = req.seed
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise APIError("seed must fit in 64 bits", param="seed")

    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=req.min_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        min_p=float(min_p),
        presence_penalty=float(req.presence_penalty),
        frequency_penalty=float(req.frequency_penalty),
        repetition_penalty=float(rep),
        logit_bias=bias,
        seed=None if seed is None else seed % (2**63),
        stop=tuple(stops),
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        no_stop_trim=req.no_stop_trim,
        stop_regex=stop_regex,
    )


def _stop_regexes(req) -> tuple[str, ...]:
    """SGLang's ``stop_regex``: each pattern passes the same caps as the ``regex`` constraint
    (size, nested unbounded quantifiers) and must compile."""
    import regex

    from llmkit.core.grammar.limits import GrammarLimits, check_spec

    value = getattr(req, "stop_regex", None)
    patterns = [value] if isinstance(value, str) else list(value or [])
    if len(patterns) > MAX_STOP:
        raise APIError(f"at most {MAX_STOP} stop_regex patterns are allowed", param="stop_regex")
    for p in patterns:
        try:
            check_spec("regex", p, GrammarLimits())
            regex.compile(p)
        except (ValueError, regex.error) as exc:
            raise APIError(f"stop_regex {p[:80]!r} is invalid: {exc}", param="stop_regex") from None
    return tuple(patterns)


def seed_for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """n > 1 with a seed: each choice gets its own reproducible stream."""
    if params.seed is None or index == 0:
        return params
    from dataclasses import replace

    return replace(params, seed=(params.seed + index) % (2**63))
