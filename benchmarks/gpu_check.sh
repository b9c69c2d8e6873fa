#!/usr/bin/env bash
# The GPU check, for when a GPU machine is lent (CI never has one). Runs from a bare checkout
# on any machine with a CUDA build of torch: .venv/bin/python when `make setup` made one, else
# python3 with the repository's src/ on PYTHONPATH; no corpus (random tokens). Tables and logs go
# to $OUT (default benchmarks/out/gpu_check).
# Exit codes: 0 all passed; 1 a step failed or timed out (see its log); 2 no CUDA device.
# Time by design (the timeouts): one GPU at most 15 min (steps 1-4, 6; about 8 min on one
# H200); >= 2 GPUs adds step 5 (1 min) and step 7 (4 min). ROWS (default fp32,bf16,compile;
# also: aligned) picks the configurations of step 4.
#   1. gpu_rank0.py parity (90 s): 4 gloo workers on GPU 0 (CUDA tensors through gloo):
#      b-sdp and n-sdp at C = 1 end at DDP's parameters. First, before anything here uses CUDA.
#   2. gpu_rank0.py peak (60 s): the card's bf16 matmul rate (8192^3), what MFU is over.
#   3. gpu_rank0.py leak (90 s): rank 0 of llama-1b built, stepped and dropped four times
#      (b-sdp, n-sdp in turn): the memory left allocated after each drop stays flat.
#   4. gpu_rank0.py rank0 (480 s): rank 0 of an 8-worker llama-1b run on the GPU over the fake
#      process group, each configuration in a fresh process: ddp, fsdp+ac, b-sdp C=0.69,
#      b-sdp+fsdp+ac, n-sdp, b-sdp+zero2 in fp32 (1 x 2048) and bf16-mixed (4 x 2048), and
#      ddp, b-sdp, n-sdp with --compile: torch.cuda.max_memory_allocated vs the estimator
#      (+-5%, eager rows), step time, tokens/s, MFU (executed FLOPs and torchtitan's); the
#      profile of ddp's bf16 step, eager and compiled; the estimates run on the CPUs meanwhile.
#   5. gpu_rank0.py comms (60 s, >= 2 GPUs: NCCL refuses two ranks on one GPU): device memory
#      per extra NCCL communicator, split from the world one (docs/plans.md, --comm-mem-mb).
#   6. tests/gpu (180 s): NCCL parity with DDP for every strategy, SDP+FSDP composition parity,
#      estimated vs measured memory, a CUDA training run, the Hugging Face example; multi-rank
#      tests skip below 2 GPUs.
#   7. benchmarks/composition_measured.py on NCCL (>= 2 GPUs, 240 s): composed strategies'
#      step time and peak memory vs DDP and FSDP2, prefetch on/off.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-benchmarks/out/gpu_check}
ROWS=${ROWS:-fp32,bf16,compile}
mkdir -p "$OUT"
gpus=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo none)
if [ "$gpus" = none ]; then
    echo "gpu_check: $PY cannot import torch: run make setup, or set PY to a python with" \
         "a CUDA build of torch (exit 2)" >&2
    exit 2
fi
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
step peak 60 $PY benchmarks/gpu_rank0.py peak --out "$OUT"
step leak 90 $PY benchmarks/gpu_rank0.py leak --out "$OUT"
step rank0 480 $PY benchmarks/gpu_rank0.py rank0 --out "$OUT" --rows "$ROWS" --profile
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
echo "gpu_check: done (status $status); logs and tables (rank0.md, mfu.md, parity.md, comms.md, profile_*.txt) in $OUT"
exit $status
