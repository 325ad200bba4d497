"""ViT and Swin transformer classifiers, built from a VisionConfig.

Defaults for unset fields: mlp_ratio 4, Swin window 7 and head_dim 32 (heads = width / 32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ballast.v1 import model_pb2
from services.zoo.base import MLP, Block, ZooModel, init_weights, sum_cross_entropy
from services.zoo.graph import Inputs, Layer, LayerList


def mlp_width(cfg: model_pb2.VisionConfig, dim: int) -> int:
    return int(dim * (cfg.mlp_ratio or 4.0))


class ClassifierHead(nn.Module):
    """Final LayerNorm, pooling (ViT: CLS token, Swin: mean over tokens), linear, summed loss."""

    def __init__(self, dim: int, classes: int, *, cls_token: bool, eps: float) -> None:
        super().__init__()
        self.cls_token = cls_token
        self.norm, self.fc = nn.LayerNorm(dim, eps=eps), nn.Linear(dim, classes)

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        x = self.norm(x)
        return sum_cross_entropy(self.fc(x[:, 0] if self.cls_token else x.mean(1)), labels)


class ViTEmbed(nn.Module):
    def __init__(self, cfg: model_pb2.VisionConfig, dropout: float) -> None:
        super().__init__()
        grid = cfg.image_size // cfg.patch_size
        self.patch = nn.Conv2d(cfg.channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.hidden_size))
        self.positions = nn.Parameter(torch.zeros(1, grid * grid + 1, cfg.hidden_size))
        nn.init.normal_(self.positions, std=0.02)
        self.drop = nn.Dropout(dropout)

    def forward(self, pixel_values: Tensor) -> Tensor:
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        return self.drop(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.positions)


class ViT(ZooModel):
    """Patch embedding + CLS + learned positions, pre-LN blocks; loss summed over images."""

    def __init__(self, spec: model_pb2.ModelSpec) -> None:
        super().__init__(spec)
        cfg, p = spec.vision, spec.dropout
        d = cfg.hidden_size
        self.embed = ViTEmbed(cfg, p)
        self.blocks = nn.ModuleList(
            Block(d, cfg.num_heads, mlp_width(cfg, d), p, pre_norm=True, eps=1e-6,
                  tokens=(cfg.image_size // cfg.patch_size) ** 2 + 1) for _ in range(cfg.num_layers)
        )
        self.head = ClassifierHead(d, cfg.num_classes, cls_token=True, eps=1e-6)
        init_weights(self)

    def forward(self, inputs: Inputs) -> Tensor:
        x = self.embed(inputs["pixel_values"])
        for block in self.blocks:
            x = block(x)
        return self.head(x, inputs["labels"])

    def layer_list(self) -> list[Layer]:
        out = LayerList()
        out.add("embed", "embed", self.embed, batch_keys=("pixel_values",))
        for i, block in enumerate(self.blocks):
            out.add(f"block.{i}", "block", block)
        out.add("head", "head", self.head, batch_keys=("labels",))
        return out.layers


def swin_geometry(cfg: model_pb2.VisionConfig) -> tuple[list[int], list[int], int]:
    """(width per stage, patch-grid side per stage, window side); widths double, sides halve."""
    side = cfg.image_size // cfg.patch_size
    stages = range(len(cfg.depths))
    return [cfg.hidden_size << i for i in stages], [side >> i for i in stages], cfg.window_size or 7


class PatchEmbed(nn.Module):
    def __init__(self, cfg: model_pb2.VisionConfig, dropout: float) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cfg.channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.norm, self.drop = nn.LayerNorm(cfg.hidden_size), nn.Dropout(dropout)

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.drop(self.norm(self.proj(pixel_values).flatten(2).transpose(1, 2)))


def windows(x: Tensor, w: int) -> Tensor:
    """[B, H, W, C] -> [B, windows, w*w, C]."""
    b, h, wd, c = x.shape
    return x.view(b, h // w, w, wd // w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(b, -1, w * w, c)


def unwindows(x: Tensor, w: int, h: int, wd: int) -> Tensor:
    b, c = x.shape[0], x.shape[-1]
    return x.view(b, h // w, wd // w, w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, wd, c)


class SwinBlock(nn.Module):
    """(Shifted-)window attention with a per-block relative-position-bias table, then an MLP; pre-LN."""

    def __init__(self, dim: int, side: int, heads: int, window: int, shift: int, hidden: int, dropout: float) -> None:
        super().__init__()
        if side <= window:  # the whole map is one window: nothing to shift
            window, shift = side, 0
        self.side, self.window, self.shift, self.heads, self.dropout = side, window, shift, heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        nn.init.trunc_normal_(self.bias_table, std=0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("bias_index", rel[..., 0] * (2 * window - 1) + rel[..., 1], persistent=False)
        self.register_buffer("shift_mask", self._shift_mask() if shift else None, persistent=False)
        self.drop = nn.Dropout(dropout)
        self.mlp = MLP(dim, hidden, dropout)

    def _shift_mask(self) -> Tensor:
        """-inf between tokens that the cyclic shift brought together from different regions."""
        region = torch.zeros(1, self.side, self.side, 1)
        cuts = (slice(0, -self.window), slice(-self.window, -self.shift), slice(-self.shift, None))
        for n, (hs, ws) in enumerate((h, w) for h in cuts for w in cuts):
            region[:, hs, ws, :] = n
        ids = windows(region, self.window).squeeze(-1)[0]  # [windows, w*w]
        same = ids[:, :, None] == ids[:, None, :]
        return torch.zeros(same.shape).masked_fill(~same, float("-inf")).unsqueeze(1)  # [windows, 1, N, N]

    def attention(self, x: Tensor) -> Tensor:
        b, nw, n, c = x.shape
        q, k, v = self.qkv(x).view(b, nw, n, 3, self.heads, c // self.heads).permute(3, 0, 1, 4, 2, 5)
        bias = self.bias_table[self.bias_index].permute(2, 0, 1)  # [heads, N, N]
        if self.shift_mask is not None:
            bias = bias + self.shift_mask
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)
        return self.proj(y.transpose(2, 3).reshape(b, nw, n, c))

    def forward(self, x: Tensor) -> Tensor:
        b, _, c = x.shape
        h = self.norm1(x).view(b, self.side, self.side, c)
        if self.shift:
            h = torch.roll(h, (-self.shift, -self.shift), (1, 2))
        h = unwindows(self.attention(windows(h, self.window)), self.window, self.side, self.side)
        if self.shift:
            h = torch.roll(h, (self.shift, self.shift), (1, 2))
        x = x + self.drop(h.reshape(b, -1, c))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """2x2 neighbouring patches concatenated and projected: halves the side, doubles the width."""

    def __init__(self, dim: int, side: int) -> None:
        super().__init__()
        self.side = side
        self.norm, self.reduction = nn.LayerNorm(4 * dim), nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, _, c = x.shape
        x = x.view(b, self.side, self.side, c)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x.reshape(b, -1, 4 * c)))


class Swin(ZooModel):
    """Stages of doubling width joined by patch merging; loss summed over images.

    Layers: "embed", "stage.S.block.B", "stage.S.merge" (first layer of stage S >= 1, where the
    width changes), "head". Every layer reads only its predecessor.
    """

    def __init__(self, spec: model_pb2.ModelSpec) -> None:
        super().__init__(spec)
        cfg, p = spec.vision, spec.dropout
        widths, sides, window = swin_geometry(cfg)
        head_dim = cfg.head_dim or 32
        self.embed = PatchEmbed(cfg, p)
        self.merges = nn.ModuleList(PatchMerging(widths[s - 1], sides[s - 1]) for s in range(1, len(widths)))
        self.stages = nn.ModuleList(
            nn.ModuleList(
                SwinBlock(dim, side, dim // head_dim, window, (window // 2) * (b % 2), mlp_width(cfg, dim), p)
                for b in range(depth)
            )
            for dim, side, depth in zip(widths, sides, cfg.depths, strict=True)
        )
        self.head = ClassifierHead(widths[-1], cfg.num_classes, cls_token=False, eps=1e-5)
        init_weights(self)

    def forward(self, inputs: Inputs) -> Tensor:
        x = self.embed(inputs["pixel_values"])
        for s, stage in enumerate(self.stages):
            if s:
                x = self.merges[s - 1](x)
            for block in stage:
                x = block(x)
        return self.head(x, inputs["labels"])

    def layer_list(self) -> list[Layer]:
        out = LayerList()
        out.add("embed", "embed", self.embed, batch_keys=("pixel_values",))
        for s, stage in enumerate(self.stages):
            if s:
                out.add(f"stage.{s}.merge", "merge", self.merges[s - 1])
            for b, block in enumerate(stage):
                out.add(f"stage.{s}.block.{b}", "block", block)
        out.add("head", "head", self.head, batch_keys=("labels",))
        return out.layers
