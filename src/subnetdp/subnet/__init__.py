"""Turning a model plus one worker's row of the plan into its physical subnetwork."""

from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.auto import NoBlocksError, auto_adapter

__all__ = ["NoBlocksError", "UnitAdapter", "auto_adapter"]
