#!/usr/bin/env bash
# The GPU check, for when a GPU machine is lent (CI never has one). Needs the venv
# (`make setup`, with a CUDA build of torch already in .venv or on the system: setup keeps any
# torch it finds). Tables and logs go to $OUT (default benchmarks/out/gpu_check).
# Exit codes: 0 all passed; 1 a step failed or timed out (see its log); 2 no CUDA device.
# Time by design (the timeouts): one GPU at most 9 min (steps 1, 2, 4); >= 2 GPUs adds step 3
# (1 min) and step 5 (4 min).
#   1. gpu_rank0.py parity (90 s): 4 gloo workers on GPU 0 (CUDA tensors through gloo):
#      b-sdp and n-sdp at C = 1 end at DDP's parameters. First, before anything here uses CUDA.
#   2. gpu_rank0.py rank0 (270 s): rank 0 of an 8-worker llama-1b run on the GPU over the fake
#      process group, for ddp, fsdp+ac, b-sdp C=0.69, b-sdp+fsdp+ac, n-sdp, b-sdp+zero2:
#      torch.cuda.max_memory_allocated vs the estimator (+-5%), step time, tokens/s, MFU
#      (torchtitan's and the executed-FLOP one); the estimates run on the CPUs meanwhile.
#   3. gpu_rank0.py comms (60 s, >= 2 GPUs: NCCL refuses two ranks on one GPU): device memory
#      per extra NCCL communicator, split from the world one (docs/plans.md, --comm-mem-mb).
#   4. tests/gpu (180 s): NCCL parity with DDP for every strategy, SDP+FSDP composition parity,
#      estimated vs measured memory, a CUDA training run, the Hugging Face example; multi-rank
#      tests skip below 2 GPUs.
#   5. benchmarks/composition_measured.py on NCCL (>= 2 GPUs, 240 s): composed strategies'
#      step time and peak memory vs DDP and FSDP2, prefetch on/off.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/out/gpu_check}
mkdir -p "$OUT"
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "gpu_check: $gpus GPU(s); torch $($PY -c 'import torch; print(torch.__version__)')"
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check: no CUDA device (torch.cuda.device_count() is 0): nothing measured;" \
         "run it on a GPU machine with a CUDA build of torch (exit 2)" >&2
    exit 2
fi
status=0
step() {  # step NAME SECONDS COMMAND...: run it with a timeout, log to $OUT/NAME.log
    local name=$1 secs=$2
    shift 2
    echo "gpu_check: $name (at most ${secs} s)"
    timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log" || { echo "gpu_check: $name FAILED"; status=1; }
}
step parity 90 $PY benchmarks/gpu_rank0.py parity --out "$OUT"
step rank0 270 $PY benchmarks/gpu_rank0.py rank0 --out "$OUT"
if [ "$gpus" -ge 2 ]; then
    step comms 60 $PY benchmarks/gpu_rank0.py comms --out "$OUT"
fi
# NCCL orders several communicators on one GPU by host launch order (NCCL >= 2.26): the
# SDP schedule is checked to have one global order, this makes the device follow it.
export NCCL_LAUNCH_ORDER_IMPLICIT=1
step tests_gpu 180 $PY -m pytest -p no:cacheprovider -q -rs tests/gpu
if [ "$gpus" -ge 2 ]; then
    nproc=$(( gpus < 4 ? gpus : 4 ))
    step composition 240 $PY benchmarks/composition_measured.py --device cuda --nproc "$nproc" \
        --dim 512 --layers 8 --batch 4 --seq 512 --out "$OUT"
else
    echo "gpu_check: one GPU: NCCL communicator memory and the composed step/memory table" \
         "need >= 2 (skipped)"
fi
echo "gpu_check: done (status $status); logs and tables (rank0.md, parity.md, comms.md) in $OUT"
exit $status
