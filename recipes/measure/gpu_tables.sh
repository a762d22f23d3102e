#!/usr/bin/env bash
# The GPU figures docs/benchmarks.md asks for, one part per call (each part fits in about ten minutes on one H100):
#
#   recipes/measure/gpu_tables.sh tests        # make test-gpu: every one-GPU config, compile, fp16, profiler, resume
#   recipes/measure/gpu_tables.sh speed        # tokens/s and MFU against LlamaForCausalLM, eager and compiled
#   recipes/measure/gpu_tables.sh memory       # peak memory of each model at 16 x 1024, each in its own process
#   recipes/measure/gpu_tables.sh strategies   # one process, FSDP2, ZeRO-2, ZeRO-3 on one GPU, eager and compiled
#   recipes/measure/gpu_tables.sh gemm         # a decoder layer's GEMMs at each tp's slice: share of peak by shape
#   recipes/measure/gpu_tables.sh lease        # all of it that fits one ten-minute call, most wanted first, each part
#                                              # cut off at its share (tests in parallel; the timed parts alone):
#                                              # about 7 minutes on one H200
#
# The tests launch `<python's bin>/deepspeed`: where DeepSpeed was installed elsewhere (pip --target), link its
# launcher there first.
#
# Run from the repository root in an environment with the GPU's torch (make setup TORCH=...). Logs and tables go to
# $OUT (default runs/gpu); every command is printed before it runs, for the docs to name it.
set -u
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"
run() { echo "+ $*" | tee -a "$OUT/commands.txt"; "$@"; }

case "${1:-}" in
tests)
    run "$PY" -m pytest -m gpu -q -p no:cacheprovider --timeout 580 2>&1 | tee "$OUT/test_gpu.log"
    ;;
speed)
    for compile in "" "--torch_compile"; do
        run "$PY" recipes/measure/benchmark.py --presets gpt2-124m --seq_len 1024 --batch_size 16 --steps 20 --warmup 5 \
            $compile --write "$OUT/speed.md" 2>&1 | tee -a "$OUT/speed.log"
        run "$PY" recipes/measure/benchmark.py --presets llama-1b --seq_len 2048 --batch_size 4 --steps 20 --warmup 5 \
            $compile --write "$OUT/speed.md" 2>&1 | tee -a "$OUT/speed.log"
    done
    ;;
memory)
    for compile in "" "--torch_compile"; do
        run "$PY" recipes/measure/benchmark.py --presets gpt2-124m --seq_len 1024 --batch_size 16 --steps 5 --warmup 3 \
            --separate $compile --write "$OUT/memory.md" 2>&1 | tee -a "$OUT/memory.log"
    done
    ;;
strategies)
    for compile in "" "--torch_compile"; do
        run "$PY" recipes/compare.py --preset gpt2-124m --strategies single,fsdp,zero2,zero3 --nproc 1 --steps 30 \
            --per_device_train_batch_size 16 --no_save --no_trainer --output_dir "$OUT/strategies${compile:+-compiled}" \
            --block_size 1024 --bf16 $compile 2>&1 | tee -a "$OUT/strategies.log"
    done
    ;;
gemm)
    for config in llama-3-8b llama-3-70b; do
        run "$PY" recipes/measure/gemm_efficiency.py --config_file "model/configs/$config.json" --tokens 8192 16384 \
            --json "$OUT/gemm-$config.json" 2>&1 | tee -a "$OUT/gemm.md"
    done
    ;;
lease)
    # The timed tables run alone on the GPU; the tests (tiny models) run 8 at a time. Each part gets at most its share
    # of LEASE_S seconds (default 560) and what is left of them, so what finished comes back even if a later part
    # would not fit.
    end=$((SECONDS + ${LEASE_S:-560}))
    upto() { local left=$((end - SECONDS)); echo $((left < $1 ? (left > 0 ? left : 1) : $1)); }
    parallel=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
    run timeout "$(upto 80)" "$PY" recipes/measure/benchmark.py --presets gpt2-124m --seq_len 1024 --batch_size 16 \
        --steps 20 --warmup 5 --write "$OUT/speed.md" 2>&1 | tee -a "$OUT/speed.log"
    run timeout "$(upto 60)" "$PY" recipes/measure/benchmark.py --presets llama-1b --seq_len 2048 --batch_size 4 \
        --steps 20 --warmup 5 --write "$OUT/speed.md" 2>&1 | tee -a "$OUT/speed.log"
    run timeout "$(upto 40)" "$PY" recipes/measure/gemm_efficiency.py --json "$OUT/gemm.json" 2>&1 \
        | tee -a "$OUT/speed.md"
    run timeout "$(upto 240)" "$PY" -m pytest -m gpu -q -p no:cacheprovider $parallel --timeout 230 2>&1 \
        | tee "$OUT/test_gpu.log"
    run timeout "$(upto 90)" "$PY" recipes/measure/benchmark.py --presets gpt2-124m --seq_len 1024 --batch_size 16 \
        --steps 20 --warmup 5 --torch_compile --write "$OUT/speed.md" 2>&1 | tee -a "$OUT/speed.log"
    run timeout "$(upto 300)" "$PY" recipes/compare.py --preset gpt2-124m --strategies single,fsdp,zero2,zero3 \
        --nproc 1 --steps 20 --per_device_train_batch_size 16 --no_save --no_trainer --output_dir /tmp/strategies \
        --block_size 1024 --bf16 2>&1 | tee -a "$OUT/strategies.log"
    cp /tmp/strategies/*.md "$OUT/" 2>/dev/null
    ;;
*)
    echo "usage: $0 tests|speed|memory|strategies|gemm|lease" >&2
    exit 2
    ;;
esac
