"""The storage tier's built-in backends (``--hicache-storage-backend``): local files and Redis."""

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_kv_storage(register):
    register("file", "llmkit.plugins.kv_storage.file:FileKVStorage", default=True)
    register("redis", "llmkit.plugins.kv_storage.redis:RedisKVStorage")
