"""Turning a model plus one worker's row of the plan into its physical subnetwork."""

from subnetdp.subnet.adapter import UnitAdapter

__all__ = ["UnitAdapter"]
