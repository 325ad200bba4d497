"""Hugging Face architectures cut into Ballast's layers: embeddings, each block, final norm + head.

Each layer is a small wrapper over the Hugging Face model's own submodules (the very Parameters, so a tied
embedding is found by identity, zoo.graph.decompose), and computes what the Hugging Face model's forward computes
around that submodule: positions, the attention mask (transformers' own mask functions, which leave sdpa's causal
flag to do the work when nothing is padded), rotary position embeddings (from the model's rotary module, which
the block wrapper holds, so its buffer travels with a migrated layer), and at the end the loss summed over
labelled tokens or samples. Causal LM labels are already shifted (label k is token k + 1, -100 where none), as
the data path draws them; `hf_labels` gives the Hugging Face model's unshifted labels for the same batch.

Tensor parallelism: a block declares which of its linears split column-wise and row-wise
(`tensor_parallel_plan`: Llama-family configs' own `base_model_tp_plan`; BERT and ViT by their module names) and
the degrees that divide its heads, key-value heads and MLP width (`tensor_parallel_ways`, 0 with dropout). The
attention modules read their head count off the projection's output (`view(..., -1, head_dim)`), so a shard runs
its own heads; grouped-query attention keeps its query-to-key-value ratio when the degree divides both. GPT-2's
blocks use fused Conv1D projections, which torch's tensor parallelism does not split: they run DP or SDP.

Sequence parallelism: Llama-family blocks name their TP regions (`self_attn`, called with the hidden states as a
keyword, and `mlp`) and split their sequence at degrees dividing gcd(TP ways, tokens). Under it a block holds its
part of the sequence, so the wrapper builds the mask and the rotary table for the whole sequence (the
executor says how many parts, `prepare_sequence_parallel`). BERT's and ViT's blocks add the residual inside a
row-parallel region's module, so they run TP without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_causal_mask,
    create_sliding_window_causal_mask,
)

from services.zoo.base import sum_cross_entropy
from services.zoo.graph import Layer, LayerList


def positions(x: Tensor) -> Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def dropout_free(config: PretrainedConfig) -> bool:
    """Every dropout probability of the config is 0 (hf_config set them all to the spec's dropout)."""
    return not any(isinstance(v, int | float) and not isinstance(v, bool) and v > 0
                   for k, v in config.to_dict().items() if k.endswith(("dropout", "pdrop", "dropout_prob")))


class Block(nn.Module):
    """One Hugging Face block, called as its model calls it."""

    def __init__(self, block: nn.Module, config: PretrainedConfig, mask: Callable[..., Tensor | None] | None,
                 rotary: nn.Module | None = None, tp_plan: dict[str, str] | None = None,
                 tp_sizes: tuple[int, ...] = (), sp_regions: dict[str, str | int] | None = None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config, self.mask = config, mask  # plain attributes: neither is a module, parameter or buffer
        self._tp_plan, self._tp_sizes = dict(tp_plan or {}), tp_sizes
        self._sp_regions = {f"block.{path}": arg for path, arg in (sp_regions or {}).items()}
        self.tokens = 0  # the sequence length (HuggingFace.cut sets it for text tasks)
        self._sequence_parts = 1  # > 1 under sequence parallelism: this block holds 1/parts of the sequence

    def forward(self, x: Tensor) -> Tensor:
        # the whole sequence's shape (a view, no copy) for what is built from its length
        whole = x if self._sequence_parts == 1 else x[:, :1].expand(x.shape[0], x.shape[1] * self._sequence_parts,
                                                                       *x.shape[2:])
        kwargs = {}
        if self.mask is not None:  # no position_ids: they only serve to find packed sequences, which arange has none of
            kwargs["attention_mask"] = self.mask(config=self.config, inputs_embeds=whole, attention_mask=None,
                                                 cache=None)
        if self.rotary is not None:
            pos = positions(whole)
            kwargs["position_ids"] = pos
            kwargs["position_embeddings"] = self.rotary(whole, position_ids=pos)
        return self.block(x, **kwargs)

    def sequence_parallel_regions(self) -> dict[str, str | int]:
        """TP region -> the argument holding its hidden states (a keyword name or a position)."""
        return dict(self._sp_regions)

    def sequence_parallel_ways(self) -> int:
        ways = self.tensor_parallel_ways()
        return math.gcd(ways, self.tokens) if ways and self._sp_regions and self.tokens else 0

    def prepare_sequence_parallel(self, parts: int) -> None:
        self._sequence_parts = parts

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Submodule path (from this wrapper) -> "colwise" | "rowwise" (hybrid.tensor_parallel_block)."""
        return {f"block.{path}": style for path, style in self._tp_plan.items()}

    def tensor_parallel_ways(self) -> int:
        """TP degrees dividing this split whole heads and MLP columns; 0: not splittable (or dropout > 0)."""
        if not self._tp_plan or not dropout_free(self.config):
            return 0
        return math.gcd(*self._tp_sizes)


def bidirectional(config: PretrainedConfig, inputs_embeds: Tensor, **_: object) -> Tensor | None:
    return create_bidirectional_mask(config=config, inputs_embeds=inputs_embeds, attention_mask=None)


class Head(nn.Module):
    """Final norm (if any), the output projection and the summed loss."""

    def __init__(self, norm: nn.Module | None, out: nn.Module, first_token: bool = False) -> None:
        super().__init__()
        self.norm, self.out, self.first_token = norm, out, first_token

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        if self.norm is not None:
            x = self.norm(x)
        if self.first_token:  # image classification: the [CLS] token's state
            x = x[:, 0, :]
        return sum_cross_entropy(self.out(x), labels)


class GPT2Embed(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.drop(self.wte(input_ids) + self.wpe(positions(input_ids)))


class Embed(nn.Module):
    """The model's embedding module on one batch field (token ids, or pixels)."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, field: Tensor) -> Tensor:
        return self.embed(field)


class BertEmbed(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        return self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)


def _chain(embed: nn.Module, keys: tuple[str, ...], blocks: list[nn.Module], head: nn.Module) -> list[Layer]:
    out = LayerList()
    out.add("embed", "embed", embed, batch_keys=keys)
    for i, block in enumerate(blocks):
        out.add(f"block.{i}", "block", block)
    out.add("head", "head", head, batch_keys=("labels",))
    return out.layers


def gpt2(model: nn.Module, config: PretrainedConfig) -> list[Layer]:
    t = model.transformer
    blocks = [Block(b, config, create_causal_mask) for b in t.h]
    return _chain(GPT2Embed(t.wte, t.wpe, t.drop), ("input_ids",), blocks, Head(t.ln_f, model.lm_head))


def llama(model: nn.Module, config: PretrainedConfig) -> list[Layer]:
    """Llama, Mistral, Qwen2: RMSNorm, rotary positions, grouped-query attention, gated MLP."""
    base = model.model
    plan = {path.removeprefix("layers.*."): style for path, style in (config.base_model_tp_plan or {}).items()
            if path.startswith("layers.*.") and style in ("colwise", "rowwise")}
    sizes = (config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads,
             config.intermediate_size)
    layer_types = getattr(config, "layer_types", None)

    def mask(i: int) -> Callable[..., Tensor | None]:
        sliding = (layer_types[i] == "sliding_attention" if layer_types
                   else getattr(config, "sliding_window", None) is not None and config.model_type == "mistral")
        return create_sliding_window_causal_mask if sliding else create_causal_mask

    regions = {"self_attn": "hidden_states", "mlp": 0} if {"self_attn.o_proj", "mlp.down_proj"} <= set(plan) else {}
    blocks = [Block(b, config, mask(i), rotary=base.rotary_emb, tp_plan=plan, tp_sizes=sizes, sp_regions=regions)
              for i, b in enumerate(base.layers)]
    return _chain(Embed(base.embed_tokens), ("input_ids",), blocks, Head(base.norm, model.lm_head))


BERT_TP = {"attention.self.query": "colwise", "attention.self.key": "colwise", "attention.self.value": "colwise",
           "attention.output.dense": "rowwise", "intermediate.dense": "colwise", "output.dense": "rowwise"}


def bert(model: nn.Module, config: PretrainedConfig) -> list[Layer]:
    base = model.bert
    sizes = (config.num_attention_heads, config.intermediate_size)
    blocks = [Block(b, config, bidirectional, tp_plan=BERT_TP, tp_sizes=sizes) for b in base.encoder.layer]
    return _chain(BertEmbed(base.embeddings), ("input_ids", "token_type_ids"), blocks, Head(None, model.cls))


VIT_TP = {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
          "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}


def vit(model: nn.Module, config: PretrainedConfig) -> list[Layer]:
    base = model.vit
    sizes = (config.num_attention_heads, config.intermediate_size)
    blocks = [Block(b, config, None, tp_plan=VIT_TP, tp_sizes=sizes) for b in base.layers]
    return _chain(Embed(base.embeddings), ("pixel_values",), blocks,
                  Head(base.layernorm, model.classifier, first_token=True))


ADAPTERS: dict[str, Callable[[nn.Module, PretrainedConfig], list[Layer]]] = {
    "gpt2": gpt2, "llama": llama, "mistral": llama, "qwen2": llama, "bert": bert, "vit": vit,
}
