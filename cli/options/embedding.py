"""``llmkit serve``'s options for embedding, reranking and scoring models."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.option_table import ServeOption, panel

EMBEDDING_OPTIONS = panel(
    "Embeddings and rerank",
    ServeOption(
        ("--is-embedding",),
        bool,
        False,
        to="server",
        envvar="LLMKIT_IS_EMBEDDING",
        help="Serve the model at /v1/embeddings (an encoder such as BertModel is recognised from its "
        "config without it; a causal LM embeds its last token, Qwen3-Embedding style); generation "
        "routes then answer 400.",
    ),
    ServeOption(
        ("--is-reranker",),
        bool,
        False,
        to="server",
        envvar="LLMKIT_IS_RERANKER",
        help="Serve a causal LM as a yes/no reranker (Qwen3-Reranker style) at /v1/rerank and /v1/score; "
        "cross-encoders (BertForSequenceClassification) are recognised from their config without it.",
    ),
    ServeOption(
        ("--rerank-instruction",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_RERANK_INSTRUCTION",
        help="The <Instruct> of an --is-reranker model's prompt (default: Qwen3-Reranker's, for web search).",
    ),
    ServeOption(
        ("--pooler-config",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_POOLER_CONFIG",
        help="An embedding model's pooling over what its files say, as vLLM's JSON: "
        '{"pooling_type": "MEAN" | "CLS" | "LAST", "normalize": true | false}.',
    ),
    ServeOption(
        ("--max-embedding-inputs",),
        int,
        2048,
        to="server",
        envvar="LLMKIT_MAX_EMBEDDING_INPUTS",
        help="The most inputs one /v1/embeddings request (documents of a /v1/rerank, pairs of a "
        "/v1/score) may carry (OpenAI's cap: 2048).",
    ),
)
