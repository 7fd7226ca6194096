"""``llmkit serve``'s options for draft tokens verified by the target model (SGLang's flags)."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.option_table import ServeOption, panel

SPECULATIVE_OPTIONS = panel(
    "Speculative decoding",
    ServeOption(
        ("--speculative-algorithm",),
        Optional[str],
        None,
        to="engine",
        help="Speculative decoding: NGRAM (draft tokens looked up in the prompt and output so far), "
        "STANDALONE (a draft model), EAGLE / EAGLE3 (EAGLE-1/2, EAGLE-3 draft heads), MTP (DeepSeek-V3's "
        "own MTP layer), "
        "or a plugin's name; the output is "
        "unchanged, only faster where the draft is right.",
    ),
    ServeOption(
        ("--speculative-num-draft-tokens",),
        int,
        4,
        to="engine",
        help="Most draft tokens a request verifies per step (each step emits up to this + 1 tokens).",
    ),
    ServeOption(
        ("--speculative-num-steps",),
        Optional[int],
        None,
        to="engine",
        help="SGLang's draft depth: given, the most draft tokens a step (in place of "
        "--speculative-num-draft-tokens, as SGLang uses num_steps + 1 verified tokens at top-k 1).",
    ),
    ServeOption(
        ("--speculative-eagle-topk",),
        Optional[int],
        None,
        to="engine",
        help="SGLang's candidates per draft step: 1 (one chain), or more for a tree of candidates verified "
        "in one forward (at most --speculative-num-draft-tokens nodes, "
        "--speculative-num-steps deep).",
    ),
    ServeOption(
        ("--speculative-draft-model-path",),
        Optional[str],
        None,
        to="engine",
        help="STANDALONE: the draft model (a smaller model with the same tokenizer); EAGLE, EAGLE3: the "
        "head's directory; MTP: where the MTP layer is, if not in the target's.",
    ),
    ServeOption(
        ("--speculative-draft-device",),
        Optional[str],
        None,
        to="engine",
        help="STANDALONE: the device the draft model runs on (cpu, cuda, cuda:N) when not the target's, e.g. "
        "cpu to leave the GPU's memory to the target. The heads (EAGLE, EAGLE3, MTP) run on the target's.",
    ),
    ServeOption(
        ("--speculative-ngram-min-match-window-size",),
        int,
        2,
        to="engine",
        help="NGRAM: the fewest trailing tokens that must match an earlier place to draft from it.",
    ),
    ServeOption(
        ("--speculative-ngram-max-match-window-size",),
        int,
        4,
        to="engine",
        help="NGRAM: the most trailing tokens matched (the longest match wins).",
    ),
)
