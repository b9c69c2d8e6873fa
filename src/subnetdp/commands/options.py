"""Command-line options shared by several subcommands (kept torch-free: `plan` imports it)."""

from __future__ import annotations

import argparse


def add_neuron_arguments(p: argparse.ArgumentParser) -> None:
    """How n-sdp / nb-sdp split each layer pair (``subnet.neurons.make_neuron_plan``)."""
    p.add_argument("--neuron-groups", type=int, default=None,
                   help="n-sdp/nb-sdp: groups per layer pair (default: the world size, or "
                        "its smallest multiple that makes coverage x groups whole)")
    p.add_argument("--neuron-kinds", default=None,
                   help="n-sdp/nb-sdp: pair kinds to split, e.g. ffn or ffn,heads "
                        "(default: all)")
    p.add_argument("--rotate", action="store_true",
                   help="n-sdp/nb-sdp: rotate each layer's spread window by the layer index")
