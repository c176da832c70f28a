#!/usr/bin/env bash
# The checks a lent GPU machine runs (the device tool; torch with CUDA, transformers,
# accelerate, pytest there, this project not installed): one call, each step bounded and all of
# them inside one budget, most wanted first; its output in $OUT/log, the CUDA-made goldens of
# the main job in $OUT/goldens-cuda.tar.gz (test them here with `pytest --xla --golden-dir
# DIR`), each pytest run's JUnit XML beside them, a cProfile of a batched extraction in
# $OUT/extract.prof.
#   bash bench/gpu_checks.sh [seconds for all of it, default 560: 432 s on an H200 without the
#       last step] [the verdict bench's dtypes, default bfloat16 (206 s on an H200; all three
#       took 262 s before)] [the verdict bench's --hidden-size, default 64 (512 with six
#       models: 125 s for bfloat16 on an H200)]; float32 on six models after it
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PLUGIN=(-p pytest_layerparity.plugin -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning)
END=$(( $(date +%s) + ${1:-560} ))
step() { echo; echo "=== $* ($(date +%T))"; }
# within SECONDS COMMAND...: the command, stopped after SECONDS or when the budget runs out
within() {
    local left=$(( END - $(date +%s) ))
    (( left < 10 )) && { echo "(left out: the budget is spent)"; return; }
    timeout $(( $1 < left ? $1 : left )) "${@:2}"
}
{
step environment
nvidia-smi -L
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__, torch.cuda.get_device_name(0))"

step "how far CUDA's float32 attention kernels lean toward zero, beside the perturbed runs' lean (10 s)"
within 60 python3 bench/bench_tensor_core_attention.py

step "how far CUDA's GELU kernels lean along GELU's other form (verdict.KERNEL_LEAN allows bf16 4.9, f16 0.3), and its ops' rounding"
within 60 python3 bench/bench_xla_kernels.py --gelu-forms --device cuda
within 60 python3 bench/bench_xla_kernels.py --device cuda

step "bench_extraction on CUDA: each call's perturbed runs as one batch, then one at a time"
within 120 python3 bench/bench_extraction.py --device cuda --layers 8 --seq-len 2048
within 120 python3 bench/bench_extraction.py --device cuda --layers 8 --seq-len 2048 --one-at-a-time

step "main job: goldens of the embedded model made on CUDA"
rm -rf /tmp/goldens-cuda
within 100 python3 -m pytest -q "${PLUGIN[@]}" --gpu-golden --extract --golden-device cuda \
    --golden-dir /tmp/goldens-cuda --junitxml "$OUT/extract-cuda.xml"
tar -C /tmp -czf "$OUT/goldens-cuda.tar.gz" goldens-cuda

step "main job: the embedded (CPU-made) goldens reproduced on CUDA"
within 60 python3 -m pytest -q "${PLUGIN[@]}" --gpu-golden --golden-device cuda --junitxml "$OUT/reproduce-cuda.xml"

step "main job: the model's own layers on CUDA against the embedded goldens"
within 90 python3 -m pytest -q "${PLUGIN[@]}" --target cuda --junitxml "$OUT/target-cuda.xml"

step "where a batched extraction's time goes (cProfile, 2 layers of 2048 tokens)"
within 60 python3 -m cProfile -o "$OUT/extract.prof" bench/bench_extraction.py --device cuda --layers 2 \
    --seq-len 2048 --repeats 1

step "CUDA unit tests (TF32 wide matmuls, metrics, decode steps)"
within 60 python3 -m pytest -q "${PLUGIN[@]}" tests/unit/test_perturb.py tests/unit/test_metrics.py \
    tests/unit/test_step_inputs.py -k "tf32 or cuda"

step "bench_verdicts: goldens on the CPU, correct ports and planted bugs on CUDA, ${2:-bfloat16}, width ${3:-64}"
within 600 python3 bench/bench_verdicts.py --golden-device cpu --port-target cuda \
    --dtypes "${2:-bfloat16}" --hidden-size "${3:-64}" --skip-k --skip-sweep

step "bench_verdicts on CUDA, float32, six models (104 s on an H200)"
within 200 python3 bench/bench_verdicts.py --golden-device cpu --port-target cuda --dtypes float32 \
    --models minimax_m2,llama,qwen3_moe,phi,gemma2,bert --skip-k --skip-sweep
step done
} 2>&1 | tee "$OUT/log"
