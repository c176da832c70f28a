#!/usr/bin/env bash
# The checks a lent GPU machine runs (the device tool; torch with CUDA, transformers,
# accelerate, pytest there, this project not installed): one call, each step bounded, its
# output in $OUT/log, the CUDA-made goldens of the main job in $OUT/goldens-cuda.tar.gz (test
# them here with `pytest --xla --golden-dir DIR`), each pytest run's JUnit XML beside them.
#   bash bench/gpu_checks.sh [seconds for bench_verdicts (0: left out), default 240] \
#       [seconds for each bench_extraction, default 150]
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PLUGIN=(-p pytest_layerparity.plugin -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning)
step() { echo; echo "=== $* ($(date +%T))"; }
{
step environment
nvidia-smi -L
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__, torch.cuda.get_device_name(0))"

step "CUDA unit tests (TF32 wide matmuls, metrics, decode steps)"
timeout 120 python3 -m pytest -q "${PLUGIN[@]}" tests/unit/test_perturb.py tests/unit/test_metrics.py \
    tests/unit/test_step_inputs.py -k "tf32 or cuda"

step "main job: goldens of the embedded model made on CUDA"
rm -rf /tmp/goldens-cuda
timeout 180 python3 -m pytest -q "${PLUGIN[@]}" --gpu-golden --extract --golden-device cuda \
    --golden-dir /tmp/goldens-cuda --junitxml "$OUT/extract-cuda.xml"
tar -C /tmp -czf "$OUT/goldens-cuda.tar.gz" goldens-cuda

step "main job: the embedded (CPU-made) goldens reproduced on CUDA"
timeout 180 python3 -m pytest -q "${PLUGIN[@]}" --gpu-golden --golden-device cuda --junitxml "$OUT/reproduce-cuda.xml"

step "main job: the model's own layers on CUDA against the embedded goldens"
timeout 180 python3 -m pytest -q "${PLUGIN[@]}" --target cuda --junitxml "$OUT/target-cuda.xml"

step "bench_extraction on CUDA, wide matmuls of 16-bit operands in TF32, then in IEEE float32"
timeout ${2:-150} python3 bench/bench_extraction.py --device cuda --layers 8 --seq-len 2048
timeout ${2:-150} python3 bench/bench_extraction.py --device cuda --layers 8 --seq-len 2048 --ieee-matmul

step "bench_verdicts: goldens on the CPU, correct ports and planted bugs on CUDA"
[ "${1:-240}" != 0 ] && timeout "${1:-240}" python3 bench/bench_verdicts.py --golden-device cpu --port-target cuda \
    --dtypes bfloat16,float32,float16 --skip-k --skip-sweep
step done
} 2>&1 | tee "$OUT/log"
