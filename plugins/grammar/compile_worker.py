"""The grammar-compiler subprocess: ``python compile_worker.py`` (run by path, imports no llmkit).

xgrammar compiles in C++ and cannot be interrupted, and some inputs take tens of seconds or GBs,
so compilation runs here where the parent can kill it at the deadline. Protocol on stdin/stdout:
frames of a 4-byte big-endian length and a UTF-8 JSON object (never pickle).

    parent -> {"tokenizer_info": str, "max_threads": int, "max_grammar_bytes": int}
    worker -> {"ready": true}
    parent -> {"kind": "json_schema"|"json_object"|"regex"|"ebnf"|"structural_tag", "source": str}   (repeated)
    worker -> {"ok": true, "compiled": str, "bytes": int} | {"ok": false, "error": str}
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, BinaryIO


def read_frame(stream: BinaryIO) -> dict | None:
    """One frame from ``stream``, or None at end of input."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_frame(stream: BinaryIO, message: dict) -> None:
    body = json.dumps(message).encode()
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def _check_meta_schema(source: str) -> str | None:
    """The schema's own validity per its draft (jsonschema is optional)."""
    try:
        import jsonschema
    except ImportError:
        return None
    schema = json.loads(source)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"{exc.message}{' (at ' + where + ')' if where else ''}"
    return None


def compile_one(xgr: Any, compiler: Any, job: dict, max_grammar_bytes: int) -> dict:
    kind, source = job["kind"], job["source"]
    try:
        if kind == "json_schema":
            error = _check_meta_schema(source)
            if error:
                return {"ok": False, "error": error}
            # Compact output: with any_whitespace the 135M model pads JSON with newlines.
            compiled = compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
        elif kind == "json_object":
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif kind == "regex":
            compiled = compiler.compile_regex(source)
        elif kind == "ebnf":
            compiled = compiler.compile_grammar(source)
        elif kind == "structural_tag":  # {"type": "structural_tag", "format": ...}; xgrammar checks the rest
            compiled = compiler.compile_structural_tag(source)
        else:
            return {"ok": False, "error": f"unknown grammar kind {kind!r}"}
    except RecursionError:
        return {"ok": False, "error": "the grammar is nested too deeply"}
    except MemoryError:
        return {"ok": False, "error": "the grammar is too large to compile"}
    except Exception as exc:  # xgrammar reports every invalid input as an exception
        return {"ok": False, "error": str(exc)}
    size = int(compiled.memory_size_bytes)
    if size > max_grammar_bytes:
        return {"ok": False, "error": f"the compiled grammar is too large ({size >> 20} MiB)"}
    # A grammar that admits no token at all (e.g. a $ref cycle) would leave the sampler nothing.
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    if not matcher.is_terminated() and not bool(mask.any()):
        return {"ok": False, "error": "the grammar matches no output (is there a $ref cycle?)"}
    return {"ok": True, "compiled": compiled.serialize_json(), "bytes": size}


def main() -> None:
    # No PR_SET_PDEATHSIG: it fires when the *thread* that spawned us exits. A dead parent closes
    # our stdin instead, and we exit after the current job.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints from libraries go to stderr, never into the protocol
    inp = sys.stdin.buffer
    init = read_frame(inp)
    if init is None:
        return
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=int(init.get("max_threads", 1)), cache_enabled=False)
    max_bytes = int(init.get("max_grammar_bytes", 64 << 20))
    write_frame(out, {"ready": True})
    while (job := read_frame(inp)) is not None:
        write_frame(out, compile_one(xgr, compiler, job, max_bytes))


if __name__ == "__main__":
    main()
