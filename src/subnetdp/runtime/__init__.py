"""The SDP runtime: the DDP-style wrapper, holder process groups, the holder-averaging reducer."""

from subnetdp.runtime.groups import HolderGroups
from subnetdp.runtime.reducer import CommStats, HolderReducer, global_buckets
from subnetdp.runtime.wrapper import SubnetDataParallel

__all__ = ["CommStats", "HolderGroups", "HolderReducer", "SubnetDataParallel", "global_buckets"]
