"""ResNet-18 for small images: plain model (``model.py``) and its subnetdp adapter."""

from subnetdp.models.resnet.adapter import RESNET_ADAPTER
from subnetdp.models.resnet.model import BasicBlock, ResNet18, init_resnet_module

__all__ = ["RESNET_ADAPTER", "BasicBlock", "ResNet18", "init_resnet_module"]
