#!/usr/bin/env bash
# GPU side of the check (one command on the GPU machine, ~8 minutes), after prepare.sh on the CPU side:
#   bash benchmarks/gpu_check/run.sh OUTDIR [sections...]
# sections (default all but modes): tests features probe http kernels functional bench, and modes (the engine in
# its own process against a thread of the server's, ~90 s). features runs beside tests: the server tests of the
# vision-language, LoRA, rerank and decoder-embedding models on CUDA (tiny models with their own tokenizers). BENCH_TRANSFORMERS=" " adds the
# transformers baseline to the in-process benchmarks (slow: ~30 s a run). Every section has its own time limit and
# log under OUTDIR; OUTDIR/check.tar.gz holds them all and summary.md the figures
# (what benchmarks/RESULTS.md is rewritten from). A rerun of a part: TESTS_K="expr" selects GPU tests,
# FEATURES_FILES="tests/..." the feature test files (fp32 only). PYSPY=1 records the server's threads with
# py-spy (carried by prepare.sh) during each HTTP run, into logs/spy_*.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/gpu_check}
shift || true
SECTIONS=${*:-tests features probe http kernels functional bench}
mkdir -p "$OUT/logs"
L="$OUT/logs"
exec > >(tee -a "$OUT/summary.md") 2>&1  # what this prints (each section's figures) is also the summary file
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*"; }

stamp install
if [ -z "${SKIP_INSTALL:-}" ]; then  # (SKIP_INSTALL=1: an environment that has everything, e.g. a dry run on CPU)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$L/install.log" 2>&1 || { cat "$L/install.log"; exit 1; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$L/install.log" 2>&1 \
    || { cat "$L/install.log"; exit 1; }
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    git log -1 --format='commit %h %s' 2>/dev/null || true
} > "$L/env.txt" 2>&1
cat "$L/env.txt"

if has features; then  # in the background, beside the GPU tests: servers of tiny models on CUDA
    stamp "feature server tests on CUDA (fp32 against transformers; bf16 smoke)"
    (
        export LLMKIT_MAX_TOTAL_TOKENS=32768 LLMKIT_CUDA_GRAPH_MAX_BS=16  # defaults only: a test's own flags win
        export LLMKIT_TEST_TOKENIZER_DIR=$PWD/.whl/smollm2-tokenizer  # the embedded model's package is not there
        FEATURES=${FEATURES_FILES:-"tests/multimodal/test_vision_server.py tests/lora/test_lora_server.py
            tests/embedding/test_rerank_api.py tests/embedding/test_decoder_models.py
            tests/lora/test_lora_vision.py tests/speculative/test_speculative_images.py
            tests/speculative/test_standalone.py"}
        LLMKIT_DTYPE=float32 timeout 240 python3 -m pytest -q -n 4 --dist loadscope -p no:cacheprovider -rfEs \
            --timeout 200 $FEATURES > "$L/features_fp32.log" 2>&1 &
        [ -z "${FEATURES_FILES:-}" ] && timeout 150 python3 -m pytest -q -n 3 --dist loadscope -p no:cacheprovider \
            -rfEs --timeout 120 tests/multimodal/test_vision_server.py -k "stream_equals or anthropic or generate_image" \
            > "$L/features_bf16.log" 2>&1
        wait
    ) &
    FEATURES_PID=$!
fi
if has tests; then
    stamp "gpu tests (each in its own process)"
    timeout 200 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -rfEs ${TESTS_K:+-k "$TESTS_K"} \
        tests/attention/test_triton_attention.py tests/model/quant/test_int4_triton.py tests/model/moe/test_fused_moe_triton.py \
        tests/kvcache/test_kv_cache_dtype.py tests/engine/test_cuda_graph.py tests/lora/test_lora_sgmv_triton.py \
        $(ls tests/model/test_fused_ops.py tests/model/test_triton_gemv.py tests/model/test_gemv_choice.py \
            tests/model/test_hybrid_triton.py 2>/dev/null) \
        > "$L/gpu_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$L/gpu_tests.log" | tail -25
fi
if has features; then
    wait $FEATURES_PID
    for f in "$L"/features_*.log; do echo "${f##*/}:"; grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -25; done
fi
if has probe; then
    stamp "MLA extend probe"
    timeout 40 python3 benchmarks/gpu_check/mla_probe.py > "$L/mla_probe.log" 2>&1; cat "$L/mla_probe.log" | tail -20
    stamp "decode GEMV probe (the fused GEMV kernel against norm/SiLU + cuBLAS, per projection)"
    timeout 150 python3 benchmarks/gpu_check/gemv_probe.py > "$L/gemv_probe.log" 2>&1; cat "$L/gemv_probe.log" | tail -22
fi
serve_and_bench() {  # preset tag "serve flags" then bench runs "n:out" ...
    local preset=$1 tag=$2 flags=$3; shift 3
    local dir=/tmp/model-$preset
    mkdir -p $dir && python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from gpu_presets import write_model_dir; write_model_dir('$preset', Path('$dir'))"
    python3 -m llmkit.cli.main serve --model-path $dir --load-format dummy --port 30123 --batch-storage none $flags \
        > "$L/serve_$tag.log" 2>&1 &
    local pid=$!
    python3 -c "
import os, time, urllib.request
for _ in range(480):  # 4 minutes at most, and not a moment once the server has exited
    try:
        urllib.request.urlopen('http://127.0.0.1:30123/health', timeout=2); break
    except Exception:
        if not os.path.exists('/proc/$pid') or open('/proc/$pid/stat').read().split()[2] == 'Z':
            break
        time.sleep(0.5)
"
    stamp "$tag ready"
    for run in "$@"; do
        local n=${run%%:*} o=${run##*:}
        local spy=""
        if [ -n "${PYSPY:-}" ] && [ -x /tmp/site/bin/py-spy ]; then  # the server's threads, sampled during the run
            /tmp/site/bin/py-spy record -p $pid --threads --nonblocking --rate 500 --format raw \
                -o "$L/spy_${tag}_${n}x${o}.txt" > "$L/spy_${tag}_${n}x${o}.log" 2>&1 &
            spy=$!
        fi
        timeout 120 python3 -m llmkit.cli.main bench serve --base-url http://127.0.0.1:30123 --num-prompts $n \
            --backend openai-completions --random-input-len 6 --random-output-len $o --ignore-eos --no-progress \
            --json "$OUT/http_${tag}_${n}x${o}.json" > "$L/http_${tag}_${n}x${o}.log" 2>&1
        [ -n "$spy" ] && { kill -INT $spy; wait $spy; }
        grep -E "Successful|Failed|throughput|Mean TTFT|Median TTFT|Mean TPOT|Median TPOT" "$L/http_${tag}_${n}x${o}.log"
    done
    kill $pid; wait $pid 2>/dev/null
    grep -E "KV pool|max running|Warm-up|warm-up|graphs|captured" "$L/serve_$tag.log" | head -8
}
if has http; then
    stamp "HTTP: llama-3.1-8b"
    if [ -n "${HTTP_PRESET:-}" ]; then  # a dry run: HTTP_PRESET=tiny
        serve_and_bench "$HTTP_PRESET" "$HTTP_PRESET" "" 1:8 4:8
    else
        serve_and_bench llama-3.1-8b llama8b "" 1:500 100:500
        stamp "HTTP: qwen2.5-0.5b"
        serve_and_bench qwen2.5-0.5b qwen05 "" 1:500
        stamp "HTTP: qwen3.6-27b-like (hybrid: Gated DeltaNet layers, the state cache)"
        serve_and_bench qwen3.6-27b-like qwen36 "" 1:500 16:500
    fi
fi
if has modes; then  # the engine in the server's process (a thread) against its own process
    stamp "HTTP: llama-3.1-8b, engine in its own process"
    serve_and_bench llama-3.1-8b llama8b_proc --engine-process 1:500 100:500
    stamp "HTTP: qwen2.5-0.5b, engine in its own process"
    serve_and_bench qwen2.5-0.5b qwen05_proc --engine-process 1:500
fi
if has kernels; then
    stamp "kernels a decode step launches (fused on, with the decode GEMVs, off)"
    timeout 120 python3 benchmarks/gpu_check/count_kernels.py > "$L/kernels.log" 2>&1; tail -1 "$L/kernels.log"
fi
if has functional; then
    stamp "functional pass (openai client)"
    timeout 70 python3 benchmarks/gpu_check/functional.py .whl/smollm2-tokenizer > "$L/functional.log" 2>&1
    grep -E "^[a-z_]+: " "$L/functional.log"
fi
if has bench; then
    stamp "in-process benchmarks"
    timeout 45 python3 benchmarks/bench_gpu.py --preset qwen2.5-0.5b --scenario single --markdown --attention triton \
        ${BENCH_TRANSFORMERS:---no-transformers} --json "$OUT/qwen_single.json" > "$L/bench_qwen_single.log" 2>&1
    [ -n "${BENCH_UNFUSED:-}" ] && LLMKIT_DISABLE_FUSED_KERNELS=1 timeout 40 python3 benchmarks/bench_gpu.py --preset qwen2.5-0.5b --scenario single \
        --attention triton --no-transformers --json "$OUT/qwen_single_unfused.json" > "$L/bench_qwen_unfused.log" 2>&1
    timeout 75 python3 benchmarks/bench_gpu.py --preset llama-3.1-8b --attention triton ${BENCH_TRANSFORMERS:---no-transformers} --markdown \
        --json "$OUT/llama8b.json" > "$L/bench_llama8b.log" 2>&1
    # the runs above take the decode GEMVs where they time faster (LLMKIT_TRITON_GEMV unset); the
    # single streams again with cuBLAS only (=0, the default before) and with the GEMVs forced (=1)
    for g in 0 1; do
        LLMKIT_TRITON_GEMV=$g timeout 45 python3 benchmarks/bench_gpu.py --preset qwen2.5-0.5b --scenario single \
            --attention triton --no-transformers --json "$OUT/qwen_single_gemv$g.json" > "$L/bench_qwen_gemv$g.log" 2>&1
        LLMKIT_TRITON_GEMV=$g timeout 60 python3 benchmarks/bench_gpu.py --preset llama-3.1-8b --scenario single \
            --attention triton --no-transformers --json "$OUT/llama8b_single_gemv$g.json" > "$L/bench_llama8b_gemv$g.log" 2>&1
    done
    grep -h -E "decode block|could not time the decode GEMVs" "$L"/bench_*.log | sort | uniq -c | head -12
    grep -E "decode tok/s|output tok/s|^\|" "$L"/bench_*.log | sed "s|^$L/||" | tail -30
fi
stamp done
tar czf "$OUT/check.tar.gz" -C "$OUT" logs summary.md $(cd "$OUT" && ls *.json 2>/dev/null)
