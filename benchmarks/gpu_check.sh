#!/usr/bin/env bash
# The GPU check, for when a GPU machine is lent (CI never has one): under 8 minutes on one
# 8-GPU or 1-GPU machine. Needs the venv (`make setup`, with a CUDA build of torch already in
# .venv or on the system: setup keeps any torch it finds).
#   1. tests/gpu: NCCL parity with DDP for every strategy, SDP+FSDP composition parity (with
#      the checked prefetch schedule), estimated vs torch.cuda.max_memory_allocated memory, a
#      CUDA training run, the Hugging Face example; multi-rank tests skip below 2 GPUs.
#   2. benchmarks/composition_measured.py on NCCL (one GPU per worker, up to 4): step time and
#      peak memory of the composed strategies vs DDP and FSDP2, prefetch on/off; needs >= 2
#      GPUs. Results go to $OUT (default benchmarks/out/gpu_check), not to benchmarks/results.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/out/gpu_check}
mkdir -p "$OUT"
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "gpu_check: $gpus GPU(s); torch $($PY -c 'import torch; print(torch.__version__)')"
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check: no CUDA device; nothing to do" >&2
    exit 2
fi
status=0
# NCCL orders several communicators on one GPU by host launch order (NCCL >= 2.26): the
# SDP schedule is checked to have one global order, this makes the device follow it.
export NCCL_LAUNCH_ORDER_IMPLICIT=1
timeout 300 $PY -m pytest -p no:cacheprovider -q -rs tests/gpu 2>&1 | tee "$OUT/tests_gpu.log" \
    || status=1
if [ "$gpus" -ge 2 ]; then
    nproc=$(( gpus < 4 ? gpus : 4 ))
    timeout 240 $PY benchmarks/composition_measured.py --device cuda --nproc "$nproc" \
        --dim 512 --layers 8 --batch 4 --seq 512 --out "$OUT" 2>&1 | tee "$OUT/composition.log" \
        || status=1
else
    echo "gpu_check: one GPU: the composed step/memory table needs >= 2 (skipped)"
fi
echo "gpu_check: done (status $status); logs and tables in $OUT"
exit $status
