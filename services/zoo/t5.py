"""T5 encoder-decoder: RMS layer norms without bias, bias-free linears, relative position bias.

As in T5 the relative-position-bias table lives in the first block of each stack and every block
of that stack uses it. Here each block recomputes the (batch-independent) bias from the shared table
instead of receiving the first block's bias tensor: a pipeline then syncs a tiny shared Parameter
(declared in `Decomposition.shared`) rather than relaying a heads x seq x seq tensor between stages.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ballast.v1 import model_pb2
from services.zoo.base import TiedLinear, ZooModel, init_weights, sum_cross_entropy
from services.zoo.graph import Inputs, Layer, LayerList
from services.zoo.text import ffn_width

BUCKETS, MAX_DISTANCE, EPS = 32, 128, 1e-6


class RelativeBias(nn.Module):
    """T5's bucketed relative position bias: [1, heads, q_len, k_len] from a (buckets, heads) table."""

    def __init__(self, heads: int, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.table = nn.Embedding(BUCKETS, heads)

    def buckets(self, rel: Tensor) -> Tensor:
        n, out = BUCKETS, torch.zeros_like(rel)
        if self.bidirectional:
            n //= 2
            out = (rel > 0).long() * n
            rel = rel.abs()
        else:
            rel = -torch.clamp(rel, max=0)
        exact = n // 2
        log = (
            exact + (torch.log(rel.float().clamp(min=1) / exact) / math.log(MAX_DISTANCE / exact) * (n - exact)).long()
        )
        return out + torch.where(rel < exact, rel, log.clamp(max=n - 1))

    def forward(self, q_len: int, k_len: int, device: torch.device) -> Tensor:
        rel = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
        return self.table(self.buckets(rel)).permute(2, 0, 1).unsqueeze(0)


class Attention(nn.Module):
    """T5 attention: no biases, no 1/sqrt(d) scaling (T5 folds it into the initialisation)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: Tensor, bias: Tensor | None, kv: Tensor | None = None) -> Tensor:
        kv = x if kv is None else kv
        b, s, d = x.shape

        def split(t: Tensor) -> Tensor:
            return t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)

        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            split(self.q(x)), split(self.k(kv)), split(self.v(kv)), attn_mask=bias, dropout_p=p, scale=1.0
        )
        return self.o(y.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__(
            nn.Linear(dim, hidden, bias=False), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, dim, bias=False)
        )


class T5Block(nn.Module):
    """Encoder block (self-attn, FFN) or decoder block (causal self-attn, cross-attn, FFN); pre-norm."""

    def __init__(self, cfg: model_pb2.TransformerConfig, dropout: float, rel: RelativeBias, decoder: bool) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.decoder, self.rel = decoder, rel
        self.norm1, self.attn = nn.RMSNorm(d, eps=EPS), Attention(d, cfg.num_heads, dropout)
        if decoder:
            self.norm_cross, self.cross = nn.RMSNorm(d, eps=EPS), Attention(d, cfg.num_heads, dropout)
        self.norm2, self.ffn = nn.RMSNorm(d, eps=EPS), FeedForward(d, ffn_width(cfg), dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, encoder_out: Tensor | None = None) -> Tensor:
        s = x.shape[1]
        bias = self.rel(s, s, x.device)
        if self.decoder:
            bias = bias.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        x = x + self.drop(self.attn(self.norm1(x), bias))
        if self.decoder:
            x = x + self.drop(self.cross(self.norm_cross(x), None, encoder_out))
        return x + self.drop(self.ffn(self.norm2(x)))


class Embed(nn.Module):
    def __init__(self, shared: nn.Embedding, dropout: float) -> None:
        super().__init__()
        self.shared, self.drop = shared, nn.Dropout(dropout)

    def forward(self, ids: Tensor) -> Tensor:
        return self.drop(self.shared(ids))


class FinalNorm(nn.Sequential):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__(nn.RMSNorm(dim, eps=EPS), nn.Dropout(dropout))


class T5Head(nn.Module):
    """Decoder final norm, LM projection (tied: rescaled by d^-0.5 as in T5) and summed loss."""

    def __init__(self, cfg: model_pb2.TransformerConfig, dropout: float, tied: nn.Embedding | None) -> None:
        super().__init__()
        self.norm = FinalNorm(cfg.hidden_size, dropout)
        self.scale = cfg.hidden_size**-0.5 if tied is not None else 1.0
        self.lm = TiedLinear(cfg.hidden_size, cfg.vocab_size, tied)

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        return sum_cross_entropy(self.lm(self.norm(x) * self.scale), labels)


class T5(ZooModel):
    """Encoder over `input_ids`, decoder over `decoder_input_ids`; loss summed over decoder tokens.

    Input and output embeddings share one table when `tie_embeddings`; encoder and decoder always do.
    """

    def __init__(self, spec: model_pb2.ModelSpec) -> None:
        super().__init__(spec)
        cfg, p = spec.transformer, spec.dropout
        self.shared = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.encoder_embed, self.decoder_embed = Embed(self.shared, p), Embed(self.shared, p)
        enc_rel, dec_rel = RelativeBias(cfg.num_heads, True), RelativeBias(cfg.num_heads, False)
        self.encoder = nn.ModuleList(T5Block(cfg, p, enc_rel, False) for _ in range(cfg.num_layers))
        self.encoder_norm = FinalNorm(cfg.hidden_size, p)
        self.decoder = nn.ModuleList(T5Block(cfg, p, dec_rel, True) for _ in range(cfg.num_decoder_layers))
        init_weights(self)
        self.head = T5Head(cfg, p, self.shared if cfg.tie_embeddings else None)

    def forward(self, inputs: Inputs) -> Tensor:
        x = self.encoder_embed(inputs["input_ids"])
        for block in self.encoder:
            x = block(x)
        encoder_out = self.encoder_norm(x)
        y = self.decoder_embed(inputs["decoder_input_ids"])
        for block in self.decoder:
            y = block(y, encoder_out)
        return self.head(y, inputs["labels"])

    def layer_list(self) -> list[Layer]:
        out = LayerList()
        out.add("encoder.embed", "embed", self.encoder_embed, batch_keys=("input_ids",))
        for i, block in enumerate(self.encoder):
            out.add(f"encoder.block.{i}", "block", block)
        encoder_out = out.add("encoder.norm", "norm", self.encoder_norm)
        prev = out.add("decoder.embed", "embed", self.decoder_embed, inputs=(), batch_keys=("decoder_input_ids",))
        for i, block in enumerate(self.decoder):
            prev = out.add(f"decoder.block.{i}", "decoder_block", block, inputs=(prev, encoder_out))
        out.add("head", "head", self.head, batch_keys=("labels",))
        return out.layers
