"""Model architectures, selected by ``config.architectures[0]``."""

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_models(register):
    register("LlamaForCausalLM", "llmkit.plugins.models.llama:LlamaForCausalLM")
    register("Qwen2ForCausalLM", "llmkit.plugins.models.qwen2:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "llmkit.plugins.models.qwen3:Qwen3ForCausalLM")
