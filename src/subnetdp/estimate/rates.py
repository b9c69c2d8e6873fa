"""The compute rate the step-time model runs at, and where it came from.

A ``Rate`` is the model FLOP/s one rank sustains, with the sentence the advisor prints about
it; ``assumed`` says whether a measurement of this device produced it. The sources, in the
order ``advisor_rate`` takes them:

- ``--mfu``/``--peak-tflops``: the user's numbers (``given``);
- ``--calibration FILE``: a ``python -m subnetdp.estimate.calibrate`` record (measured then);
- ``gpu=cpu``: calibrated on the spot (``calibrate.calibrate``, quick settings: the machine as
  it is now);
- a GPU row: the device table's MFU (``cluster.Device.mfu_source`` says whether it was
  measured on that device, e.g. the H200 table of ``benchmarks/results/gpu_h200/mfu.md``, or
  is another device's measurement, hence assumed).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from subnetdp.estimate.cluster import Cluster, Device
from subnetdp.estimate.steptime import ComputeTerms

# the on-the-spot CPU calibration: seconds of matmuls, timed training steps (after two
# warm-up ones); a few seconds in all on top of starting the processes
QUICK_MATMUL_S = 0.5
QUICK_STEPS = 2
# the most counted FLOPs per training step the on-the-spot calibration runs of the requested
# recipe (a few seconds per step on a shared core); above it, llama-tiny's 4 x 128 step
QUICK_MAX_FLOPS = 2e10
# processes the on-the-spot calibration starts at most (each rank of a gpu=cpu cluster is a
# process on this machine; more than this only lengthens the measurement)
QUICK_MAX_PROCS = 16


@dataclass(frozen=True)
class Rate:
    flops: float  # model FLOP/s per rank
    source: str  # how it was obtained, printed above the table
    assumed: bool  # no measurement of this device produced it
    # host seconds per FSDP collective call (``steptime.predict_step``'s ``call_s``):
    # measured with the rate (``calibrate``'s ``fsdp_call_s``), else None: not modelled
    call_s: float | None = None
    # n-sdp's narrowed layers and activation checkpointing against the FLOP rate, measured
    # with it (``calibrate``), else None: the FLOP rate alone (assumed)
    terms: ComputeTerms | None = None

    def describe(self) -> str:
        mark = "assumed: " if self.assumed else ""
        call = ("FSDP host time per call 0 (assumed: hidden behind the device's streams)"
                if self.call_s is None else
                f"FSDP host time {self.call_s * 1e3:.3g} ms per call (measured with it)")
        t = self.terms
        terms = ("n-sdp's narrow layers and activation checkpointing at the FLOP rate "
                 "(assumed)" if t is None else
                 f"n-sdp's layers at {t.narrow_held:.2g} of their width at "
                 f"{t.narrow_efficiency:.2f} of the rate, activation checkpointing at "
                 f"{t.ac_efficiency:.2f} (measured with it)")
        return (f"compute {self.flops / 1e12:.4g} TFLOP/s per rank ({mark}{self.source}); "
                f"{call}; {terms}")


def given_rate(device: Device, dtype: str, mfu: float | None, peak_tflops: float | None) -> Rate:
    """``--mfu`` and/or ``--peak-tflops`` over the device table's other number."""
    peak = peak_tflops * 1e12 if peak_tflops else device.peak(dtype)
    share = mfu if mfu is not None else device.mfu
    peak_from = "--peak-tflops" if peak_tflops else f"{device.name}'s datasheet"
    mfu_from = "--mfu" if mfu is not None else device.mfu_source
    return Rate(peak * share, f"peak {peak / 1e12:g} TFLOP/s ({peak_from}) x MFU {share:.3g} "
                f"({mfu_from})", assumed=mfu is None and device.mfu_assumed)


def table_rate(device: Device, dtype: str) -> Rate:
    """A GPU row's rate: datasheet peak x the table's MFU, and whether that MFU was measured
    on this device. fp32 runs at the TF32 peak with the bf16-mixed measurement's MFU:
    assumed."""
    assumed = device.mfu_assumed or dtype == "fp32"
    note = "" if dtype != "fp32" else ", applied to fp32 (TF32 peak): not measured"
    return Rate(device.peak(dtype) * device.mfu,
                f"peak {device.peak(dtype) / 1e12:g} TFLOP/s x MFU {device.mfu:.3g}: "
                f"{device.mfu_source}{note}", assumed)


def calibration_rate(record: dict[str, Any], where: str) -> Rate:
    """The rate of a ``calibrate`` record: its measured model FLOP/s per process."""
    call = record.get("fsdp_call_s")  # records before it was measured lack it
    return Rate(float(record["model_flops"]),
                f"measured {where}: {record['recipe']} {record['batch_size']} x "
                f"{record['seq_len']}, {record['nproc']} processes at once, "
                f"{record.get('date', 'undated')}", assumed=False,
                call_s=float(call) if call is not None else None,
                terms=compute_terms(record))


def compute_terms(record: dict[str, Any]) -> ComputeTerms | None:
    """A ``calibrate`` record's ``ComputeTerms``; None for a record from before they were
    measured (``read_calibration`` checked them)."""
    narrow, ac = record.get("narrow"), record.get("ac_efficiency")
    if narrow is None or ac is None:
        return None
    return ComputeTerms(float(narrow["held"]), float(narrow["efficiency"]), float(ac))


KEYS = ("model_flops", "recipe", "batch_size", "seq_len", "nproc")


def read_calibration(path: str | Path) -> dict[str, Any]:
    """A ``calibrate --out`` file, checked; a bad one is a one-line ``ValueError``."""
    try:
        with open(path) as f:
            record = json.load(f)
    except OSError as e:
        raise ValueError(f"--calibration {path}: cannot read it ({e.strerror}); write one "
                         "with python -m subnetdp.estimate.calibrate --out FILE") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--calibration {path}: not JSON ({e.msg}, line {e.lineno}); write "
                         "one with python -m subnetdp.estimate.calibrate --out FILE") from None
    missing = [k for k in KEYS if not isinstance(record, dict) or k not in record]
    if missing:
        raise ValueError(f"--calibration {path}: lacks {', '.join(missing)}; it is not a "
                         "python -m subnetdp.estimate.calibrate record")
    flops = record["model_flops"]
    if not isinstance(flops, (int, float)) or not math.isfinite(flops) or flops <= 0:
        raise ValueError(f"--calibration {path}: model_flops must be a FLOP/s rate > 0, got "
                         f"{flops!r}")
    # the compute terms (``compute_terms``): absent in records from before they were measured
    narrow = record.get("narrow")
    values = {} if "ac_efficiency" not in record else {"ac_efficiency": record["ac_efficiency"]}
    if narrow is not None:
        values.update({f"narrow.{k}": narrow.get(k) for k in ("held", "efficiency")}
                      if isinstance(narrow, dict) else {"narrow": narrow})
    bad = [f"{k} = {v!r}" for k, v in values.items() if not (
        isinstance(v, (int, float)) and math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"--calibration {path}: {', '.join(bad)}: each must be a number > 0; "
                         "write the file again with python -m subnetdp.estimate.calibrate")
    return dict(record)


def quick_calibration(recipe: str, batch: int, seq: int, nproc: int,
                      model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """``calibrate`` now with quick settings (module constants): the requested recipe and
    batch when its step is small enough, else llama-tiny's 4 x 128; at most
    ``QUICK_MAX_PROCS`` processes."""
    from subnetdp.estimate.calibrate import calibrate
    from subnetdp.models import get_recipe
    from subnetdp.subnet.costs import recipe_costs

    costs = recipe_costs(get_recipe(recipe), batch=batch, seq=seq, model_args=model_args)
    if model_args or costs.shared.flops + sum(u.flops for u in costs.units) > QUICK_MAX_FLOPS:
        recipe, batch, seq = "llama-tiny", 4, 128
    return calibrate(recipe, batch, seq, min(nproc, QUICK_MAX_PROCS), steps=QUICK_STEPS,
                     matmul_seconds=QUICK_MATMUL_S)


def advisor_rate(base: Any, cluster: Cluster, *, mfu: float | None = None,
                 peak_tflops: float | None = None, calibration: str | None = None) -> Rate:
    """The rate ``plan cluster`` runs ``base`` (a ``BenchSpec``) at: the module docstring's
    first source given, else this machine calibrated now (``Device.local``), else the device
    table's."""
    device = cluster.device
    if calibration is not None:
        if mfu is not None or peak_tflops:
            raise ValueError("--calibration gives the rate: drop --mfu and --peak-tflops")
        record = read_calibration(calibration)
        if record.get("device", "cpu") != device.name:
            raise ValueError(f"--calibration {calibration}: a record of {record.get('device')!r}, "
                             f"the cluster's gpu is {device.name}; use gpu=cpu or drop it")
        return calibration_rate(record, f"earlier ({calibration})")
    if mfu is not None or peak_tflops:
        return given_rate(device, base.dtype, mfu, peak_tflops)
    if device.local:
        return calibration_rate(quick_calibration(base.recipe, base.batch, base.seq,
                                                  cluster.world, dict(base.model_args)), "now")
    return table_rate(device, base.dtype)
