"""The load generator behind ``llmkit bench serve``, for any OpenAI-compatible server.

In the spirit of ``vllm bench serve``: requests are sent at a Poisson rate (or all at once) under
an optional concurrency cap, always streaming, and each one's time to first token, gaps between
chunks and end-to-end latency are recorded. Token counts come from the server's ``usage`` (asked
for with ``stream_options.include_usage``); a server that sends none is counted in chunks and
estimated words. Random prompts need no tokenizer and no download: words drawn from a fixed list,
one common English word being one token for the usual BPE vocabularies.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be "
    "or has had not have one their first new after two time may other city world year school "
    "house water river light music people game film river stone garden letter paper market "
    "family summer winter island station village church mountain forest table window story "
    "color number small great large early late north south east west open short long green"
).split()


@dataclass
class Prompt:
    text: str | None = None  # completions prompt, or the user message for chat
    messages: list | None = None  # chat messages, from a JSONL line
    output_len: int = 128
    est_input_len: int = 0  # words, used only when the server reports no usage


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0


def random_prompts(n: int, input_len: int, output_len: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        # random from the first word: prompts share no prefix (beyond a chat template's) to cache
        words = [rng.choice(WORDS) for _ in range(input_len)]
        out.append(Prompt(text=" ".join(words), output_len=output_len, est_input_len=input_len))
    return out


def jsonl_prompts(path: Path, n: int, output_len: int) -> list[Prompt]:
    """Lines of ``{"prompt": str}`` or ``{"messages": [...]}``, optionally with ``max_tokens``."""
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i + 1}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or not (
            isinstance(obj.get("prompt"), str) or isinstance(obj.get("messages"), list)
        ):
            raise ValueError(f'{path}:{i + 1}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
        text, msgs = obj.get("prompt"), obj.get("messages")
        words = len(text.split()) if text else sum(len(str(m.get("content", "")).split()) for m in msgs)
        out.append(
            Prompt(text=text, messages=msgs, output_len=int(obj.get("max_tokens", output_len)), est_input_len=words)
        )
    if not out:
        raise ValueError(f"{path}: no prompts")
    return [out[i % len(out)] for i in range(n)]  # cycle when asked for more than the file has


def _body(backend: str, model: str, p: Prompt, ignore_eos: bool) -> tuple[str, dict]:
    common = {
        "model": model,
        "max_tokens": p.output_len,
        "stream": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        common["ignore_eos"] = True  # vLLM, SGLang and llmkit read it; llama-server ignores it
    if backend == "openai-chat":
        msgs = p.messages if p.messages is not None else [{"role": "user", "content": p.text}]
        return "/v1/chat/completions", {**common, "messages": msgs}
    if p.text is None:
        raise ValueError("--backend openai-completions needs prompts with a 'prompt' field")
    return "/v1/completions", {**common, "prompt": p.text}


async def _one(client, backend: str, model: str, p: Prompt, ignore_eos: bool) -> Result:
    path, body = _body(backend, model, p, ignore_eos)
    res = Result()
    chunks = 0
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    return res
                if obj.get("usage"):
                    res.input_tokens = obj["usage"].get("prompt_tokens", 0)
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                if _has_text(obj):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as exc:  # a refused or dropped connection is a failed request, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - t0
    res.input_tokens = res.input_tokens or p.est_input_len
    res.output_tokens = res.output_tokens or chunks
    res.ok = chunks > 0 or res.output_tokens == 0
    if not res.ok:
        res.error = "no output"
    return res


def _has_text(obj: dict) -> bool:
    for c in obj.get("choices") or []:
        d = c.get("delta") or {}
        if c.get("text") or d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
            return True
    return False


async def _arrivals(n: int, rate: float, rng: random.Random):
    """Yield 0..n-1 at Poisson arrival times (``rate`` per second), or at once for ``inf``."""
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def _run(
    base_url: str,
    model: str | None,
    backend: str,
    prompts: list[Prompt],
    request_rate: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    api_key: str | None,
    seed: int,
    progress: bool,
) -> tuple[dict, list[Result]]:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts), max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=httpx.Timeout(3600.0), limits=limits
    ) as client:
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        spec_before = await _spec_counters(client)
        bar = tqdm(total=len(prompts), disable=not progress, unit="req", desc="bench serve")
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def guarded(p: Prompt) -> Result:
            if gate is None:
                res = await _one(client, backend, model, p, ignore_eos)
            else:
                async with gate:
                    res = await _one(client, backend, model, p, ignore_eos)
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(guarded(prompts[i]))
            async for i in _arrivals(len(prompts), request_rate, random.Random(seed))
        ]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        spec_after = await _spec_counters(client)
    summary = summarize(
        results,
        duration,
        model=model,
        backend=backend,
        base_url=base_url,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
    )
    if spec_before is not None and spec_after is not None:  # a speculating llmkit server
        steps, drafted, accepted = (a - b for a, b in zip(spec_after, spec_before))
        summary["spec_accept_length"] = (accepted + steps) / steps if steps else 0.0
        summary["spec_accept_rate"] = accepted / drafted if drafted else 0.0
    return summary, list(results)


SPEC_KEYS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")


async def _spec_counters(client) -> tuple[int, ...] | None:
    """The server's speculative decoding counters (llmkit's /get_server_info), or None: another
    server, or no speculation."""
    try:
        r = await client.get("/get_server_info")
        info = r.json() if r.status_code == 200 else {}
    except Exception:  # noqa: BLE001 - any other server: no counters to report
        return None
    return tuple(int(info[k]) for k in SPEC_KEYS) if all(k in info for k in SPEC_KEYS) else None


def _stats(name: str, values: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values)
    if not ms:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p90_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}

    def pct(q: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(ms) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (k - lo)

    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"p90_{name}_ms": pct(0.90),
        f"p99_{name}_ms": pct(0.99),
    }


def summarize(results: list[Result], duration: float, **meta) -> dict:
    ok = [r for r in results if r.ok]
    inp, out = sum(r.input_tokens for r in ok), sum(r.output_tokens for r in ok)
    d = max(duration, 1e-9)
    summary = {
        **meta,
        "request_rate": "inf" if meta.get("request_rate") == float("inf") else meta.get("request_rate"),
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": len(ok) / d,
        "input_throughput": inp / d,
        "output_throughput": out / d,
        "total_token_throughput": (inp + out) / d,
    }
    summary.update(_stats("ttft", [r.ttft for r in ok]))
    summary.update(_stats("itl", [x for r in ok for x in r.itl]))
    summary.update(_stats("tpot", [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]))
    summary.update(_stats("e2el", [r.latency for r in ok]))
    errors = [r.error for r in results if not r.ok]
    summary["errors"] = sorted(set(errors))[:10]
    return summary


def format_summary(s: dict) -> str:
    w = 50
    lines = [
        " Serving Benchmark Result ".center(w, "="),
        f"{'Backend:':<40}{s['backend']:>10}",
        f"{'Successful requests:':<40}{s['completed']:>10}",
        f"{'Failed requests:':<40}{s['failed']:>10}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:>10.2f}",
        f"{'Total input tokens:':<40}{s['total_input_tokens']:>10}",
        f"{'Total generated tokens:':<40}{s['total_output_tokens']:>10}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:>10.2f}",
        f"{'Input token throughput (tok/s):':<40}{s['input_throughput']:>10.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>10.2f}",
        f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>10.2f}",
    ]
    for key, title, label in (
        ("ttft", "Time to First Token", "TTFT"),
        ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl", "Inter-token Latency", "ITL"),
        ("e2el", "End-to-end Latency", "E2EL"),
    ):
        lines.append(f" {title} ".center(w, "-"))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{f'{name} {label} (ms):':<40}{s[f'{stat}_{key}_ms']:>10.2f}")
    if "spec_accept_length" in s:  # SGLang's bench_serving reports the accept length too
        lines.append(" Speculative Decoding ".center(w, "-"))
        lines.append(f"{'Accept length:':<40}{s['spec_accept_length']:>10.2f}")
        lines.append(f"{'Accept rate:':<40}{s['spec_accept_rate']:>10.2%}")
    lines.append("=" * w)
    if s["errors"]:
        lines.append("Errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def run_bench(
    *,
    base_url: str,
    model: str | None,
    backend: str,
    prompts: list[Prompt],
    request_rate: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    api_key: str | None,
    seed: int,
    progress: bool,
) -> dict:
    summary, _ = asyncio.run(
        _run(
            base_url.rstrip("/"),
            model,
            backend,
            prompts,
            request_rate,
            max_concurrency,
            ignore_eos,
            api_key,
            seed,
            progress,
        )
    )
    return summary
