"""The storage tier's built-in backends (``--hicache-storage-backend``): local files, Redis and S3."""

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_kv_storage(register):
    register("file", "llmkit.plugins.kv_storage.file:FileKVStorage", default=True)
    register("redis", "llmkit.plugins.kv_storage.redis:RedisKVStorage")
    register("s3", "llmkit.plugins.kv_storage.s3:S3KVStorage")
