"""ZooModel base class and the building blocks several families share."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct
from torch import Tensor, nn

from ballast.v1 import common_pb2, model_pb2
from services.zoo.graph import Decomposition, Inputs, Layer, decompose, run_layers

IGNORE_INDEX = -100  # label value that contributes nothing to the loss (unmasked BERT tokens)


def struct_values(struct: Struct) -> dict[str, Any]:
    """A Struct as plain values: its numbers are doubles, and whole ones become ints (`layers: 2` arrives as 2)."""

    def whole(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, list):
            return [whole(v) for v in value]
        if isinstance(value, dict):
            return {k: whole(v) for k, v in value.items()}
        return value

    return whole(MessageToDict(struct))


def sum_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed, not averaged: pipelines and data parallelism add partial sums, then divide once."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


class ZooModel(nn.Module):
    """A plain nn.Module: `forward(batch)` returns the loss summed over every labelled token or sample.

    The executor divides by the global `loss_count` of the mini-batch, so the result does not depend
    on how the batch was split into micro-batches or replicas. Built in fp32; `train_dtype` records the
    training precision the spec asked for, for the executor to apply.
    """

    label_keys: tuple[str, ...] = ("labels",)

    def __init__(self, spec: model_pb2.ModelSpec) -> None:
        super().__init__()
        self.spec = model_pb2.ModelSpec()
        self.spec.CopyFrom(spec)
        self.train_dtype = common_pb2.DType.Name(spec.dtype)  # e.g. "DTYPE_BF16"; weights stay fp32 here

    def layer_list(self) -> list[Layer]:
        raise NotImplementedError

    def decompose(self) -> Decomposition:
        """The ordered layers (embedding, blocks, head) sharing this model's modules and Parameters."""
        return decompose(self, self.layer_list())

    def loss_count(self, inputs: Inputs) -> int:
        """How many terms `forward(inputs)` summed: the divisor for a mean loss."""
        return int(sum(int((inputs[k] != IGNORE_INDEX).sum()) for k in self.label_keys))


class CutModel(ZooModel):
    """A model Ballast cuts into layers of its own making (a user's segments, Hugging Face blocks). The wrappers
    are made once, so every decomposition holds the same module objects (hooks on them, as chunk offload's, see
    the forward pass), and forward runs them: the model and its decomposition compute one function."""

    def __init__(self, spec: model_pb2.ModelSpec) -> None:
        super().__init__(spec)
        self._cut: list[Layer] | None = None  # plain attributes: a list of records, not registered modules
        self._run: Decomposition | None = None

    def cut(self) -> list[Layer]:
        raise NotImplementedError

    def layer_list(self) -> list[Layer]:
        if self._cut is None:
            self._cut = self.cut()
        return [replace(layer, tied_with=[]) for layer in self._cut]  # fresh records around the same modules

    def forward(self, inputs: Inputs) -> Tensor:
        if self._run is None:
            self._run = self.decompose()
        return run_layers(self._run, inputs)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT/BERT-style init (normal 0.02, zero bias) so every family trains sensibly from scratch."""
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Embedding | nn.Conv2d):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection, via scaled_dot_product_attention."""

    def __init__(self, dim: int, heads: int, dropout: float, *, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.dropout, self.causal = heads, dim // heads, dropout, causal
        # qkv rows as [q|k|v][head] (False) or [head][q|k|v] (True: tensor parallelism reorders them so a row
        # shard holds whole heads). The head count is read off the projection, so a shard runs its own heads.
        self.head_major = False
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x)
        if self.head_major:
            q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        else:
            q, k, v = qkv.view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float, approximate: str = "none") -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(approximate), nn.Linear(hidden, dim), nn.Dropout(dropout))


def to_head_major(attn: SelfAttention) -> None:
    """Reorder the fused qkv rows from [q|k|v][head] to [head][q|k|v], so a contiguous row shard is whole heads."""
    d, h, hd = attn.proj.in_features, attn.heads, attn.head_dim
    with torch.no_grad():
        attn.qkv.weight.data = attn.qkv.weight.view(3, h, hd, d).transpose(0, 1).reshape(3 * h * hd, d).clone()
        attn.qkv.bias.data = attn.qkv.bias.view(3, h, hd).transpose(0, 1).reshape(3 * h * hd).clone()
    attn.head_major = True


def qkv_rows(name: str, value: Tensor, heads: int, to_head_major: bool) -> Tensor:
    """A fused qkv parameter's (or its optimizer state's) rows moved between [q|k|v][head] and [head][q|k|v]
    (other parameters as they are): checkpoints store the model's own order, whatever the strategy."""
    if name not in ("attn.qkv.weight", "attn.qkv.bias") or value.dim() == 0:  # Adam's scalar step
        return value
    rows = value.shape[0]
    shape = (3, heads, rows // (3 * heads)) if to_head_major else (heads, 3, rows // (3 * heads))
    return value.reshape(*shape, *value.shape[1:]).transpose(0, 1).reshape(value.shape).contiguous()


class Block(nn.Module):
    """Transformer block; pre-LN (GPT, ViT) or post-LN (BERT), with the family's LN epsilon. It keeps the executors'
    TP protocol (train/hybrid.py): Megatron's split, the fused qkv column-parallel with its rows head-major."""

    def tensor_parallel_ways(self) -> int:
        """The executors split it Megatron-style (train/hybrid.py) at degrees dividing this: the gcd of its heads
        and MLP width; 0 with dropout, whose masks its tp ranks would draw apart (zoo.graph.Layer reads this; T5's
        and Swin's blocks have none)."""
        drops = [self.drop.p, self.attn.dropout, *(m.p for m in self.mlp.modules() if isinstance(m, nn.Dropout))]
        return 0 if any(p > 0 for p in drops) else math.gcd(self.attn.heads, self.mlp[0].out_features)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.0": "colwise", "mlp.2": "rowwise"}

    def sequence_parallel_ways(self) -> int:
        """TP degrees dividing this can also split the block's sequence (its tokens; 0 when not known)."""
        ways = self.tensor_parallel_ways()
        return math.gcd(ways, self.tokens) if ways and self.tokens else 0

    def sequence_parallel_regions(self) -> list[str]:
        """The TP regions: submodules whose input is gathered along the sequence under sequence parallelism (what
        reads the sequence's length runs on the whole of it); their row-parallel outputs are reduce-scattered."""
        return ["attn", "mlp"]

    def prepare_tensor_parallel(self) -> None:
        to_head_major(self.attn)

    def tensor_parallel_rows(self, name: str, value: Tensor, sharded: bool) -> Tensor:
        return qkv_rows(name, value, self.attn.heads, to_head_major=sharded)

    def __init__(
        self,
        dim: int,
        heads: int,
        hidden: int,
        dropout: float,
        *,
        pre_norm: bool,
        causal: bool = False,
        eps: float = 1e-5,
        approximate: str = "none",
        tokens: int = 0,
    ) -> None:
        super().__init__()
        self.pre_norm, self.tokens = pre_norm, tokens  # tokens: sequence length (sequence parallelism needs it)
        self.ln1, self.ln2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attn = SelfAttention(dim, heads, dropout, causal=causal)
        self.drop = nn.Dropout(dropout)
        self.mlp = MLP(dim, hidden, dropout, approximate)

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.ln1(x)))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.drop(self.attn(x)))
        return self.ln2(x + self.mlp(x))


class TiedLinear(nn.Module):
    """Output projection whose weight is, when tied, the very Parameter of an input embedding."""

    def __init__(self, dim: int, vocab: int, tied: nn.Embedding | None, *, bias: bool = False) -> None:
        super().__init__()
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab, dim))
            nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(vocab)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)
