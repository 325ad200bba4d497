"""GPT-2/GPT-3-style decoder and BERT encoder, built from a TransformerConfig."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ballast.v1 import model_pb2
from services.zoo.base import Block, TiedLinear, ZooModel, init_weights, sum_cross_entropy
from services.zoo.graph import Inputs, Layer, LayerList


def ffn_width(cfg: model_pb2.TransformerConfig) -> int:
    return cfg.ffn_hidden_size or 4 * cfg.hidden_size


def positions(cfg: model_pb2.TransformerConfig) -> int:
    return cfg.max_positions or cfg.seq_length


class GPTEmbed(nn.Module):
    def __init__(self, cfg: model_pb2.TransformerConfig, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.positions = nn.Embedding(positions(cfg), cfg.hidden_size)
        self.drop = nn.Dropout(dropout)

    def forward(self, input_ids: Tensor) -> Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.tokens(input_ids) + self.positions(pos))


class GPTHead(nn.Module):
    """Final LayerNorm, LM projection (tied to the token embedding when asked) and summed loss."""

    def __init__(self, cfg: model_pb2.TransformerConfig, tied: nn.Embedding | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.lm = TiedLinear(cfg.hidden_size, cfg.vocab_size, tied)

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        return sum_cross_entropy(self.lm(self.norm(x)), labels)


class GPT(ZooModel):
    """Learned positions, pre-LN causal blocks; loss = next-token cross-entropy summed over tokens."""

    def __init__(self, spec: model_pb2.ModelSpec) -> None:
        super().__init__(spec)
        cfg, p = spec.transformer, spec.dropout
        self.embed = GPTEmbed(cfg, p)
        self.blocks = nn.ModuleList(
            Block(cfg.hidden_size, cfg.num_heads, ffn_width(cfg), p, pre_norm=True, causal=True, approximate="tanh",
                  tokens=cfg.seq_length)
            for _ in range(cfg.num_layers)
        )
        init_weights(self)
        self.head = GPTHead(cfg, self.embed.tokens if cfg.tie_embeddings else None)

    def forward(self, inputs: Inputs) -> Tensor:
        x = self.embed(inputs["input_ids"])
        for block in self.blocks:
            x = block(x)
        return self.head(x, inputs["labels"])

    def layer_list(self) -> list[Layer]:
        out = LayerList()
        out.add("embed", "embed", self.embed, batch_keys=("input_ids",))
        for i, block in enumerate(self.blocks):
            out.add(f"block.{i}", "block", block)
        out.add("head", "head", self.head, batch_keys=("labels",))
        return out.layers


class BertEmbed(nn.Module):
    def __init__(self, cfg: model_pb2.TransformerConfig, dropout: float) -> None:
        super().__init__()
        self.words = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.positions = nn.Embedding(positions(cfg), cfg.hidden_size)
        self.token_types = nn.Embedding(2, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-12)
        self.drop = nn.Dropout(dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.norm(self.words(input_ids) + self.positions(pos) + self.token_types(token_type_ids)))


class BertHead(nn.Module):
    """Pre-training heads: pooler (dense+tanh on the first token) with next-sentence classifier,
    and masked-LM head (dense+GELU+LayerNorm, decoder tied to the word embedding, own bias).

    The 2-way next-sentence classifier (2 * hidden + 2 parameters) is what gives the pooler a gradient.
    """

    def __init__(self, cfg: model_pb2.TransformerConfig, tied: nn.Embedding | None) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.pooler = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.next_sentence = nn.Linear(d, 2)
        self.transform = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d, eps=1e-12))
        self.decoder = TiedLinear(d, cfg.vocab_size, tied, bias=True)

    def forward(self, x: Tensor, labels: Tensor, next_sentence_label: Tensor) -> Tensor:
        mlm = sum_cross_entropy(self.decoder(self.transform(x)), labels)
        return mlm + sum_cross_entropy(self.next_sentence(self.pooler(x[:, 0])), next_sentence_label)


class Bert(ZooModel):
    """Post-LN encoder; loss = masked-LM cross-entropy summed over masked tokens + next-sentence
    cross-entropy summed over samples (`loss_count` counts both)."""

    label_keys = ("labels", "next_sentence_label")

    def __init__(self, spec: model_pb2.ModelSpec) -> None:
        super().__init__(spec)
        cfg, p = spec.transformer, spec.dropout
        self.embed = BertEmbed(cfg, p)
        self.blocks = nn.ModuleList(
            Block(cfg.hidden_size, cfg.num_heads, ffn_width(cfg), p, pre_norm=False, eps=1e-12, tokens=cfg.seq_length)
            for _ in range(cfg.num_layers)
        )
        self.head = BertHead(cfg, self.embed.words if cfg.tie_embeddings else None)
        init_weights(self)

    def forward(self, inputs: Inputs) -> Tensor:
        x = self.embed(inputs["input_ids"], inputs["token_type_ids"])
        for block in self.blocks:
            x = block(x)
        return self.head(x, inputs["labels"], inputs["next_sentence_label"])

    def layer_list(self) -> list[Layer]:
        out = LayerList()
        out.add("embed", "embed", self.embed, batch_keys=("input_ids", "token_type_ids"))
        for i, block in enumerate(self.blocks):
            out.add(f"block.{i}", "block", block)
        out.add("head", "head", self.head, batch_keys=("labels", "next_sentence_label"))
        return out.layers
