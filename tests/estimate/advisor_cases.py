"""The small clusters whose advisor tables ``data/advisor_small.json`` holds, as computed
before the advisor learned to evaluate each distinct case once (a per-rank loop): the fast
path must give exactly these numbers (``test_steptime.test_advisor_tables_unchanged``). The
ddp+zero1 and bb-sdp rows were rewritten when the model learned ddp+zero1's per-parameter
broadcasts and backward masking's refresh (issue 45); no other value moved."""

# cluster, backend, overlap
CASES = (
    ("nodes=1,gpus-per-node=4,gpu=cpu", "gloo", True),
    ("nodes=2,gpus-per-node=4,gpu=h100,inter=25gbit", "nccl", True),
    ("nodes=2,gpus-per-node=4,gpu=h100,inter=25gbit", "nccl", False),
    ("nodes=2,gpus-per-node=2,gpu=a100,inter=1gbit,shared-intra=1,intra=10gbit", "nccl", True),
    ("nodes=3,gpus-per-node=2,gpu=h100,inter=100gbit,nics=2", "gloo", True),
)
KEYS = ("label", "coverage", "peak_GB", "fits", "fastest", "step_s", "compute_s",
        "exposed_comm_s", "comm_s", "exposed_s", "ring_bytes_per_rank", "wire_bytes_per_rank")
