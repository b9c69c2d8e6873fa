"""Swin Transformer (Liu et al., 2021) for small images, plain PyTorch (imports nothing from
subnetdp): patch embedding, stages of window-attention blocks with shifted windows and relative
position bias, patch merging between stages, mean-pooled classifier.

Differences from the ImageNet Swin-T, for 32×32 / 28×28 inputs: patch size 2 (not 4) and a
window of 4 (CIFAR) or 7 (28×28), so the stages see 16/8/4/2 (CIFAR) or 14/7/4/2 tokens per
side; a stage whose side is not larger than the window uses one unshifted window (as Swin).
``PatchMerging`` zero-pads an odd side (7 → 4), as Swin's detection code does.

Properties subnetdp relies on:
- Blocks take and return the residual stream ``x[B, H, W, C]`` (one positional argument) and
  own both residual connections, so a removed block is the identity.
- Q, K and V are separate ``Linear`` layers and the relative-position-bias table is
  ``[(2w-1)², heads]``: one head's parameters are contiguous slices (rows of q/k/v, column
  of the table, columns of ``proj``), so n-sdp can narrow a layer to some of its heads.
- Head counts and MLP width are read from tensor shapes in ``forward``; only ``head_dim``
  is fixed, so a physically narrowed layer (even one with zero heads) runs.
- Every parameter and buffer is rebuilt by ``init_swin_module`` on the module owning it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SwinConfig:
    image_size: int = 32
    in_channels: int = 3
    num_classes: int = 10
    patch_size: int = 2
    embed_dim: int = 96
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (3, 6, 12, 24)
    window_size: int = 4
    mlp_ratio: float = 4.0

    def __post_init__(self) -> None:
        # --model-arg values arrive as JSON lists; keep the config hashable.
        object.__setattr__(self, "depths", tuple(self.depths))
        object.__setattr__(self, "num_heads", tuple(self.num_heads))
        if len(self.depths) != len(self.num_heads) or not self.depths:
            raise ValueError(f"depths {self.depths} and num_heads {self.num_heads} must have "
                             "the same (non-zero) length: one entry per stage")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not a multiple of "
                             f"patch_size={self.patch_size}")
        for s, heads in enumerate(self.num_heads):
            if self.stage_dim(s) % heads:
                raise ValueError(f"stage {s} has {self.stage_dim(s)} channels, not divisible "
                                 f"into {heads} heads; change embed_dim or num_heads")
        for s, side in enumerate(self.stage_sides()):
            if side % self.stage_window(s):
                raise ValueError(
                    f"stage {s} is {side}×{side} tokens, not a multiple of its window "
                    f"{self.stage_window(s)}; pick window_size dividing {side}"
                )

    def stage_dim(self, s: int) -> int:
        return self.embed_dim * 2**s

    def stage_sides(self) -> list[int]:
        """Tokens per side in each stage (patch merging halves it, rounding up)."""
        side = self.image_size // self.patch_size
        sides = []
        for _ in self.depths:
            sides.append(side)
            side = (side + 1) // 2
        return sides

    def stage_window(self, s: int) -> int:
        return min(self.window_size, self.stage_sides()[s])

    def stage_shift(self, s: int) -> int:
        # One window covers the whole map: shifting would only wrap tokens around (Swin).
        return 0 if self.stage_sides()[s] <= self.window_size else self.window_size // 2


# Parameter counts with 10 classes (tests/models/test_swin.py): t-32 27,505,108; t-28 27,506,500
# (torchvision's ImageNet Swin-T: 28.3M, of which 0.77M in its 1000-class head).
SWIN_FLAVOURS: dict[str, SwinConfig] = {
    "t-32": SwinConfig(),  # Swin-T widths/depths, CIFAR 32×32×3
    "t-28": SwinConfig(image_size=28, in_channels=1, window_size=7),  # 28×28 grey
}


def swin_config(flavour: str, **overrides: object) -> SwinConfig:
    valid = [f.name for f in dataclasses.fields(SwinConfig)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown Swin config override(s) {unknown}; valid: {valid}")
    return dataclasses.replace(SWIN_FLAVOURS[flavour], **overrides)  # type: ignore[arg-type]


def trunc_normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """``nn.init.trunc_normal_(t, std=std)`` (bounds ±2) without its rejection loop.

    torch 2.13's version draws ``normal_`` once and redraws while any value is out of bounds;
    that ``any()`` needs real data, which fake tensors (the memory estimator) do not have. At
    std 0.02 the bounds are 100 std away, so the loop never redraws: one ``normal_`` and a
    clamp give the same values from the same generator state."""
    with torch.no_grad():  # as nn.init: parameters are initialised in place
        return t.normal_(0.0, std).clamp_(-2.0, 2.0)


def window_partition(x: torch.Tensor, w: int) -> torch.Tensor:
    """``[B, H, W, C]`` -> ``[B * nW, w * w, C]``, windows in row-major order per image."""
    b, h, wd, c = x.shape
    x = x.view(b, h // w, w, wd // w, w, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, w * w, c)


def window_reverse(windows: torch.Tensor, w: int, b: int, h: int, wd: int) -> torch.Tensor:
    c = windows.shape[-1]
    x = windows.view(b, h // w, wd // w, w, w, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, wd, c)


def shift_mask(h: int, wd: int, w: int, shift: int, device: torch.device) -> torch.Tensor:
    """``[nW, w*w, w*w]`` additive mask: after the cyclic shift a window may hold tokens from
    up to four regions that are not neighbours in the image; they must not attend each other."""
    region = torch.zeros(1, h, wd, 1, device=device)
    cuts = (slice(0, -w), slice(-w, -shift), slice(-shift, None))
    for i, (hs, ws) in enumerate((hs, ws) for hs in cuts for ws in cuts):
        region[:, hs, ws, :] = i
    ids = window_partition(region, w).squeeze(-1)  # [nW, N]
    same = ids[:, None, :] == ids[:, :, None]
    return torch.zeros(same.shape, device=device).masked_fill_(~same, float("-inf"))


class WindowAttention(nn.Module):
    """Multi-head self-attention inside ``w × w`` windows with a relative position bias."""

    relative_index: torch.Tensor

    def __init__(self, dim: int, num_heads: int, window: int) -> None:
        super().__init__()
        self.window, self.head_dim = window, dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        # One column per head (heads last), so a head's bias is a slice along dim 1.
        self.relative_bias = nn.Parameter(torch.empty((2 * window - 1) ** 2, num_heads))
        # Derived data: non-persistent, rebuilt by reset_parameters after to_empty.
        self.register_buffer("relative_index", torch.empty(window**2, window**2,
                                                            dtype=torch.long), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The bias table (truncated normal, std 0.02, as Swin) and the index buffer; the
        q/k/v/proj ``Linear`` children are initialised on their own."""
        trunc_normal_(self.relative_bias, std=0.02)
        w, dev = self.window, self.relative_index.device
        coords = torch.stack(torch.meshgrid(torch.arange(w, device=dev),
                                            torch.arange(w, device=dev), indexing="ij"))
        coords = coords.flatten(1)  # [2, N]
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (w - 1)
        with torch.no_grad():
            self.relative_index.copy_(rel[..., 0] * (2 * w - 1) + rel[..., 1])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``x[B*nW, N, C]``, ``mask[nW, N, N]`` or None -> ``[B*nW, N, C]``."""
        bw, n, _ = x.shape
        heads = self.relative_bias.shape[1]  # from the tensor: n-sdp may have narrowed it

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(bw, n, heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        bias = self.relative_bias[self.relative_index.view(-1)].view(n, n, heads)
        attn_mask = bias.permute(2, 0, 1).unsqueeze(0)  # [1, heads, N, N]
        if mask is not None:  # windows are ordered image by image: repeat the nW masks B times
            attn_mask = attn_mask + mask.repeat(bw // mask.shape[0], 1, 1).unsqueeze(1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.to(q.dtype))
        return self.proj(out.transpose(1, 2).reshape(bw, n, heads * self.head_dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwinBlock(nn.Module):
    """``x -> x + W-MSA(LN(x)) -> h + MLP(LN(h))`` on ``x[B, H, W, C]``; windows shifted by
    ``shift`` tokens (SW-MSA) in every other block of a stage."""

    def __init__(self, dim: int, num_heads: int, window: int, shift: int,
                 mlp_ratio: float) -> None:
        super().__init__()
        self.window, self.shift = window, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, window)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, wd, _ = x.shape
        w, s = self.window, self.shift
        y = self.norm1(x)
        mask = None
        if s:
            y = torch.roll(y, shifts=(-s, -s), dims=(1, 2))
            mask = shift_mask(h, wd, w, s, x.device)
        y = window_reverse(self.attn(window_partition(y, w), mask), w, b, h, wd)
        if s:
            y = torch.roll(y, shifts=(s, s), dims=(1, 2))
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """2×2 neighbouring tokens -> one token with twice the channels: ``[B, H, W, C]`` ->
    ``[B, ⌈H/2⌉, ⌈W/2⌉, 2C]`` (an odd side is zero-padded first)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h, wd, _ = x.shape
        if h % 2 or wd % 2:
            x = F.pad(x, (0, 0, 0, wd % 2, 0, h % 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]],
                      dim=-1)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    """``blocks`` (the units) then an optional ``downsample`` (shared, never a unit)."""

    def __init__(self, cfg: SwinConfig, s: int) -> None:
        super().__init__()
        dim, w = cfg.stage_dim(s), cfg.stage_window(s)
        self.blocks = nn.ModuleList(
            SwinBlock(dim, cfg.num_heads[s], w, cfg.stage_shift(s) if b % 2 else 0,
                      cfg.mlp_ratio)
            for b in range(cfg.depths[s])
        )
        last = s == len(cfg.depths) - 1
        self.downsample: nn.Module = nn.Identity() if last else PatchMerging(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)  # positional, x first: a removed block returns x itself
        return self.downsample(x)


class SwinTransformer(nn.Module):
    def __init__(self, cfg: SwinConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.embed_dim, cfg.patch_size,
                                     stride=cfg.patch_size)
        self.patch_norm = nn.LayerNorm(cfg.embed_dim)
        self.stages = nn.ModuleList(SwinStage(cfg, s) for s in range(len(cfg.depths)))
        self.norm = nn.LayerNorm(cfg.stage_dim(len(cfg.depths) - 1))
        self.head = nn.Linear(cfg.stage_dim(len(cfg.depths) - 1), cfg.num_classes)
        self.init_weights()

    def init_weights(self) -> None:
        """Initialise every module (skipped on meta: subnetdp initialises after ``to_empty``)."""
        if self.head.weight.is_meta:
            return
        for name, module in self.named_modules():
            init_swin_module(name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[B, C, H, W]`` -> logits ``[B, num_classes]``."""
        x = self.patch_norm(self.patch_embed(x).permute(0, 2, 3, 1))  # [B, H, W, C]
        for stage in self.stages:
            x = stage(x)
        return self.head(self.norm(x).mean(dim=(1, 2)))


def init_swin_module(name: str, module: nn.Module) -> None:
    """Initialise only what ``module`` owns directly (``recurse=False``), as Swin does:
    ``Linear`` truncated normal (std 0.02) with zero bias, LayerNorm 1/0, the patch-embedding
    conv PyTorch's default, the attention's bias table and index through its
    ``reset_parameters``. ``name`` is unused."""
    del name
    with torch.no_grad():
        if isinstance(module, nn.Linear):
            trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()  # LayerNorm, Conv2d, WindowAttention (its own tensors only)
        elif any(True for _ in module.parameters(recurse=False)) or any(
            True for _ in module.buffers(recurse=False)
        ):
            raise TypeError(f"init_swin_module does not know how to initialise "
                            f"{type(module).__name__}; add a branch for it")
