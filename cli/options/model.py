"""``llmkit serve``'s options for the model, its weights and formats, the kernels and parsers that run it."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.option_table import ServeOption, accepted_only, panel


def _served_names(names, _) -> dict:
    # The first name is the id in /v1/models (empty: launch uses the model path); the rest are aliases.
    return {
        "server.served_model_name": (names or [""])[0],
        "server.served_model_aliases": tuple((names or [])[1:]),
    }


MODEL_OPTIONS = panel(
    "Model and kernels",
    ServeOption(
        ("--model-path", "--model"),
        Optional[str],
        None,
        to="engine",
        envvar="LLMKIT_MODEL_PATH",
        help="HF model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.",
    ),
    ServeOption(
        ("--served-model-name",),
        Optional[list[str]],
        None,
        to=_served_names,
        envvar="LLMKIT_SERVED_MODEL_NAME",
        help="The model id in /v1/models (default: the model path); repeat it to add aliases requests may use. "
        "The model's Hugging Face id is accepted too when its path or config names it. "
        "Requests naming any other model get 404.",
    ),
    ServeOption(
        ("--chat-template",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_CHAT_TEMPLATE",
        help="A Jinja chat template file overriding the tokenizer's.",
    ),
    ServeOption(
        ("--generation-config",),
        str,
        "auto",
        to="server",
        envvar="LLMKIT_GENERATION_CONFIG",
        help="Sampling defaults for the fields a request leaves out (temperature, top_p, top_k, min_p, "
        "repetition_penalty), on every route: auto: the model's generation_config.json; vllm (or none): "
        "the neutral values, the file ignored; a path: a directory holding generation_config.json, or the file.",
    ),
    ServeOption(
        ("--load-format",),
        str,
        "auto",
        to="engine",
        envvar="LLMKIT_LOAD_FORMAT",
        help="auto: load the checkpoint; dummy: random weights from config.json (benchmarks).",
    ),
    ServeOption(
        ("--trust-remote-code",),
        bool,
        False,
        to=accepted_only,  # llmkit never runs a checkpoint's code: no config field
        help="Accepted for SGLang compatibility; llmkit never runs code from a checkpoint "
        "(architectures come from installed plugins), so it changes nothing.",
    ),
    ServeOption(
        ("--dtype",),
        str,
        "auto",
        to="engine",
        envvar="LLMKIT_DTYPE",
        help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16.",
    ),
    ServeOption(
        ("--quantization",),
        Optional[str],
        None,
        to="engine",
        envvar="LLMKIT_QUANTIZATION",
        help="Weights. Default: a GGUF on CPU at its own precision (Q4_0/Q4_1/Q4_K as int4, "
        "Q8_0/Q5_K/Q6_K as int8; an explicit --dtype dequantizes), anything else dense; none: dense (a GGUF "
        "dequantized); gguf: a GGUF's own precision or an error; int8 (per channel) or int4 (grouped): "
        "weight-only, quantized at load (CPU).",
    ),
    ServeOption(
        ("--quantization-group-size",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_QUANTIZATION_GROUP_SIZE",
        help="Input columns per scale for --quantization int4: 32 (default), 64, 128 or 256.",
    ),
    ServeOption(("--device",), str, "auto", to="engine", envvar="LLMKIT_DEVICE", help="auto, cpu, cuda, cuda:N."),
    ServeOption(
        ("--attention", "--attention-backend"),
        str,
        "auto",
        to="engine",
        envvar="LLMKIT_ATTENTION",
        help="Attention backend: auto, torch, triton, flashinfer, or a plugin's name.",
    ),
    ServeOption(
        ("--reasoning-parser",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_REASONING_PARSER",
        help="Separate reasoning_content: qwen3, deepseek-r1, ...",
    ),
    ServeOption(
        ("--tool-call-parser",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_TOOL_CALL_PARSER",
        help="Parse tool calls: hermes, llama3, mistral, ...",
    ),
    ServeOption(
        ("--grammar-backend",),
        Optional[str],
        None,
        to="engine",
        envvar="LLMKIT_GRAMMAR_BACKEND",
        help="Structured outputs: xgrammar, a plugin's backend, or none. Default: the grammar plugin "
        "registered as default.",
        typer_args={"show_default": "xgrammar"},
    ),
)
