"""Model architectures, selected by ``config.architectures[0]``."""

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_models(register):
    # model_types: config.json files without "architectures" (a bare PretrainedConfig) resolve by them.
    register("LlamaForCausalLM", "llmkit.plugins.models.llama:LlamaForCausalLM", model_types=("llama",))
    register("Qwen2ForCausalLM", "llmkit.plugins.models.qwen2:Qwen2ForCausalLM", model_types=("qwen2",))
    register("Qwen3ForCausalLM", "llmkit.plugins.models.qwen3:Qwen3ForCausalLM", model_types=("qwen3",))
    register("Qwen3MoeForCausalLM", "llmkit.plugins.models.qwen3_moe:Qwen3MoeForCausalLM", model_types=("qwen3_moe",))
    register(
        "Qwen2_5_VLForConditionalGeneration",
        "llmkit.plugins.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
        model_types=("qwen2_5_vl",),
    )
    register(
        "Qwen3VLForConditionalGeneration",
        "llmkit.plugins.models.qwen3_vl:Qwen3VLForConditionalGeneration",
        model_types=("qwen3_vl",),
    )
    # hybrids: Gated DeltaNet layers with a recurrent state (core/kvcache/state_pool.py)
    register("Qwen3_5ForCausalLM", "llmkit.plugins.models.qwen3_5:Qwen3_5ForCausalLM", model_types=("qwen3_5_text",))
    register(
        "Qwen3_5ForConditionalGeneration",
        "llmkit.plugins.models.qwen3_5:Qwen3_5ForConditionalGeneration",
        model_types=("qwen3_5",),
    )
    register(
        "Qwen3_5MoeForCausalLM",
        "llmkit.plugins.models.qwen3_5:Qwen3_5MoeForCausalLM",
        model_types=("qwen3_5_moe_text",),
    )
    register(
        "Qwen3_5MoeForConditionalGeneration",
        "llmkit.plugins.models.qwen3_5:Qwen3_5MoeForConditionalGeneration",
        model_types=("qwen3_5_moe",),
    )
    register(
        "Qwen3NextForCausalLM", "llmkit.plugins.models.qwen3_next:Qwen3NextForCausalLM", model_types=("qwen3_next",)
    )
    # hybrid: gated short convolutions, their last inputs as state
    register("Lfm2ForCausalLM", "llmkit.plugins.models.lfm2:Lfm2ForCausalLM", model_types=("lfm2",))
    # hybrid: Mamba2 layers (a conv state and an SSM matrix per head) beside attention and ReLU² MLPs
    register(
        "NemotronHForCausalLM",
        "llmkit.plugins.models.mamba2.nemotron_h:NemotronHForCausalLM",
        model_types=("nemotron_h",),
    )
    register(
        "GraniteMoeHybridForCausalLM",
        "llmkit.plugins.models.mamba2.granite_hybrid:GraniteMoeHybridForCausalLM",
        model_types=("granitemoehybrid",),
    )
    # dense decoders on the shared stack, each with its own twist (plugins/models/dense/)
    register("MistralForCausalLM", "llmkit.plugins.models.dense.mistral:MistralForCausalLM", model_types=("mistral",))
    register(
        "Mistral3ForConditionalGeneration",
        "llmkit.plugins.models.dense.mistral:Mistral3ForConditionalGeneration",
        model_types=("mistral3",),
    )
    register(
        "Ministral3ForCausalLM",
        "llmkit.plugins.models.dense.mistral:Ministral3ForCausalLM",
        model_types=("ministral3",),
    )
    register("Phi3ForCausalLM", "llmkit.plugins.models.dense.phi3:Phi3ForCausalLM", model_types=("phi3",))
    register("SmolLM3ForCausalLM", "llmkit.plugins.models.dense.smollm3:SmolLM3ForCausalLM", model_types=("smollm3",))
    register("Olmo2ForCausalLM", "llmkit.plugins.models.dense.olmo:Olmo2ForCausalLM", model_types=("olmo2",))
    register("Olmo3ForCausalLM", "llmkit.plugins.models.dense.olmo:Olmo3ForCausalLM", model_types=("olmo3",))
    register("GraniteForCausalLM", "llmkit.plugins.models.dense.granite:GraniteForCausalLM", model_types=("granite",))
    # routed MoE decoders (plugins/models/moe/)
    register("Llama4ForCausalLM", "llmkit.plugins.models.moe.llama4:Llama4ForCausalLM", model_types=("llama4_text",))
    register(  # served as its language model (the vision tower skipped)
        "Llama4ForConditionalGeneration", "llmkit.plugins.models.moe.llama4:Llama4ForCausalLM", model_types=("llama4",)
    )
    register("MixtralForCausalLM", "llmkit.plugins.models.moe.mixtral:MixtralForCausalLM", model_types=("mixtral",))
    register("Glm4MoeForCausalLM", "llmkit.plugins.models.moe.glm4_moe:Glm4MoeForCausalLM", model_types=("glm4_moe",))
    register(
        "MiniMaxM2ForCausalLM", "llmkit.plugins.models.moe.minimax_m2:MiniMaxM2ForCausalLM", model_types=("minimax_m2",)
    )
    register("GptOssForCausalLM", "llmkit.plugins.models.gpt_oss:GptOssForCausalLM", model_types=("gpt_oss",))
    register("Gemma3ForCausalLM", "llmkit.plugins.models.gemma3:Gemma3ForCausalLM", model_types=("gemma3_text",))
    # images in, text out (a VisionLanguageModel: the server builds its processor)
    register(
        "Gemma3ForConditionalGeneration",
        "llmkit.plugins.models.gemma3_vl:Gemma3ForConditionalGeneration",
        model_types=("gemma3",),
    )
    register("Gemma4ForCausalLM", "llmkit.plugins.models.gemma4.model:Gemma4ForCausalLM", model_types=("gemma4_text",))
    # (its text path: the vision and audio towers are not served yet)
    register(
        "Gemma4ForConditionalGeneration",
        "llmkit.plugins.models.gemma4.model:Gemma4ForConditionalGeneration",
        model_types=("gemma4",),
    )
    # Encoders serve /v1/embeddings, cross-encoders (scores=True) /v1/rerank and /v1/score
    # (embedding=True: launch serves them without the generation engine)
    # speech in, text out (a SpeechToText: served behind /v1/audio/*, not by the generation engine)
    register(
        "WhisperForConditionalGeneration",
        "llmkit.plugins.models.speech.whisper:WhisperForConditionalGeneration",
        model_types=("whisper",),
        speech=True,
    )
    register("BertModel", "llmkit.plugins.models.bert:BertModel", model_types=("bert",), embedding=True)
    register(
        "XLMRobertaModel", "llmkit.plugins.models.bert:XLMRobertaModel", model_types=("xlm-roberta",), embedding=True
    )
    for cross in ("BertForSequenceClassification", "XLMRobertaForSequenceClassification"):
        register(cross, f"llmkit.plugins.models.bert:{cross}", embedding=True, scores=True)
    # any other transformers causal LM, on transformers' modeling code (--model-impl; chosen by
    # core/engine/stages/plan.py where no class above serves the architecture)
    register("TransformersForCausalLM", "llmkit.plugins.models.transformers_fallback:TransformersForCausalLM")
    # Kimi-K2 checkpoints name the same class (model_type kimi_k2)
    register(
        "DeepseekV3ForCausalLM",
        "llmkit.plugins.models.deepseek_v3:DeepseekV3ForCausalLM",
        model_types=("deepseek_v3", "kimi_k2"),
    )
    register(
        "DeepseekV2ForCausalLM",
        "llmkit.plugins.models.deepseek_v3:DeepseekV2ForCausalLM",
        model_types=("deepseek_v2",),
    )
    register(
        "Glm4MoeLiteForCausalLM",
        "llmkit.plugins.models.deepseek_v3:Glm4MoeLiteForCausalLM",
        model_types=("glm4_moe_lite",),
    )
