"""A third-party storage backend installed through an entry point runs a whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from llmkit.testing.storage import StorageContract

from storage_plugin_utils import PLUGIN_SOURCE, install_memstore


class TestMemstoreContract(StorageContract):
    """The documented contract holds for the example third-party backend too."""

    @pytest.fixture
    def storage(self):
        ns: dict = {}
        exec(compile(PLUGIN_SOURCE, "llmkit_memstore", "exec"), ns)
        return ns["MemStorage"]()


def test_entry_point_plugin_is_discovered_and_runs_a_batch(tmp_path):
    site = install_memstore(tmp_path)
    tests_dir = os.path.join(os.path.dirname(__file__), os.pardir, "helpers")
    code = textwrap.dedent("""
        import asyncio, json, sys
        from llmkit.core.plugins import registry
        from llmkit.core.batches.storage import open_storage
        from llmkit.core.batches.runner import BatchRunner
        from batch_utils import fake_execute, jsonl, upload, read_file

        entry = registry().entry("storage", "memstore")
        assert entry.package == "llmkit-memstore", entry
        storage = open_storage("memstore", {"label": "x"})

        async def main():
            runner = BatchRunner(storage, fake_execute)
            rec = await runner.create(upload(storage, jsonl(4)), "/v1/chat/completions", "24h")
            return await runner.wait(rec.id)

        rec = asyncio.run(main())
        print(json.dumps({"status": rec.status, "counts": rec.request_counts,
                          "ids": [o["custom_id"] for o in read_file(storage, rec.output_file_id)]}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), tests_dir, os.environ.get("PYTHONPATH", "")])}
    env.pop("LLMKIT_DISABLE_PLUGIN_AUTOLOAD", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    import json

    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {
        "status": "completed",
        "counts": {"total": 4, "completed": 4, "failed": 0},
        "ids": ["r-0", "r-1", "r-2", "r-3"],
    }


def test_autoload_can_be_disabled(tmp_path):
    site = install_memstore(tmp_path)
    code = (
        "from llmkit.core.plugins import registry, PluginError\n"
        "assert 'memstore' not in registry().names('storage')\n"
        "assert {'local', 's3'} <= set(registry().names('storage'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "LLMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
