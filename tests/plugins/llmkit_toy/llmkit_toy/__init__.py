"""A third-party plugin: one of every kind (attention, model, reasoning and tool parsers, grammar
backend, a speculative algorithm, a KV storage backend, a command), each registered through the same hooks llmkit's own plugins use."""

from llmkit.core import hookimpl


@hookimpl
def llmkit_register_attention_backends(register):
    register("toy", "llmkit_toy.attention:ToyAttention")


@hookimpl
def llmkit_register_models(register):
    register("ToyLlamaForCausalLM", "llmkit_toy.model:ToyLlamaForCausalLM")


@hookimpl
def llmkit_register_commands(app):
    @app.command("toy-hello")
    def toy_hello(name: str = "world") -> None:
        """Say hello from the toy plugin."""
        print(f"hello {name} from llmkit-toy")


@hookimpl
def llmkit_register_reasoning_parsers(register):
    register("toy-think", "llmkit_toy.parsers:ToyReasoningParser")


@hookimpl
def llmkit_register_tool_parsers(register):
    register("toy-call", "llmkit_toy.parsers:ToyToolParser")


@hookimpl
def llmkit_register_speculative_algorithms(register):
    register("toy-repeat", "llmkit_toy.speculative:RepeatLast")


@hookimpl
def llmkit_register_grammar_backends(register):
    register("toy-choice", "llmkit_toy.grammar:ChoiceBackend")


@hookimpl
def llmkit_register_lora_resolvers(register):
    register("toy-shelf", "llmkit_toy.lora:ShelfResolver")


@hookimpl
def llmkit_register_kv_storage(register):
    register("toy-flat", "llmkit_toy.kv_storage:FlatKVStorage")
