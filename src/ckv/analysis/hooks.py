"""What the mechanism analyses (knock-out, gate concentration, gate cycling, joint view) share: their settings,
where they reach into a model, and forward hooks that read or overwrite the attention output at the final
position of a prompt (the position whose logits the lookup task scores).

Attention output of a layer = the input of its ``o_proj``, ``(B, T, H * D)``: the concatenated head outputs,
heads grouped by KV head (query head ``h`` belongs to KV group ``h // (H // KV)``), so KV group ``g`` owns the
columns ``[g * (H // KV) * D, (g + 1) * (H // KV) * D)``. ``o_proj`` has no bias, so replacing its whole input by
a mean replaces the layer's attention output by the mean of that output.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import torch
from torch import nn

from ckv.attention import Compressor, compressed_layers
from ckv.config import ConfigError, field_names, reject_unknown
from ckv.model import Transformer

T = TypeVar("T")


class AnalysisNotApplicable(ConfigError):
    """A mechanism analysis does not apply to this model (e.g. gate cycling on a mean-pooled model)."""


def settings_from_params(cls: type[T], params: dict[str, Any], analysis: str) -> T:
    """Build an analysis' settings dataclass from its config parameters; unknown keys are an error naming the
    valid ones. Lists become tuples (settings are frozen)."""
    reject_unknown(params, field_names(cls), f"analysis={analysis} parameter")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items()})


# ---- attention outputs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionSite:
    """The attention output of one layer: the ``o_proj`` module whose input is the concatenated head outputs."""

    layer: int
    o_proj: nn.Module
    n_heads: int
    kv_heads: int
    head_dim: int

    @property
    def width(self) -> int:
        """Columns of the o_proj input: ``n_heads * head_dim``."""
        return self.n_heads * self.head_dim

    def group_columns(self, group: int) -> slice:
        """Columns of the query heads of KV group ``group``."""
        if not 0 <= group < self.kv_heads:
            raise ValueError(f"KV group {group} is outside [0, {self.kv_heads})")
        per = self.n_heads // self.kv_heads * self.head_dim
        return slice(group * per, (group + 1) * per)

    def group_heads(self, group: int) -> list[int]:
        """Query heads of KV group ``group``."""
        per = self.n_heads // self.kv_heads
        return list(range(group * per, (group + 1) * per))


def attention_sites(module: nn.Module) -> list[AttentionSite]:
    """The attention output of every layer of a ckv ``Transformer`` or of a transformers model laid out like
    Qwen/Llama (``model.layers[i].self_attn.o_proj``, ``config.num_attention_heads``)."""
    if isinstance(module, Transformer):
        return [
            AttentionSite(i, b.self_attn.o_proj, b.self_attn.n_heads, b.self_attn.kv_heads, b.self_attn.head_dim)
            for i, b in enumerate(module.layers)
        ]
    layers = getattr(getattr(module, "model", None), "layers", None)
    cfg = getattr(module, "config", None)
    n_heads = getattr(cfg, "num_attention_heads", None)
    if layers is None or not n_heads or not all(hasattr(getattr(b, "self_attn", None), "o_proj") for b in layers):
        raise AnalysisNotApplicable(
            f"cannot find the attention outputs of {type(module).__name__}: knock-outs need a ckv Transformer or a "
            "transformers model with model.layers[i].self_attn.o_proj and config.num_attention_heads"
        )
    kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    return [
        AttentionSite(i, b.self_attn.o_proj, n_heads, kv, b.self_attn.o_proj.in_features // n_heads)
        for i, b in enumerate(layers)
    ]


class FinalInputMeans:
    """Running sums of each site's o_proj input at the final position; ``mean(layer)`` is (n_heads * D,)."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}
        self.count = 0

    def mean(self, layer: int) -> torch.Tensor:
        if not self.count:
            raise RuntimeError("no forward pass ran while capturing: the calibration set is empty")
        return (self.sums[layer] / self.count).float()


@contextmanager
def capture_final_inputs(sites: Sequence[AttentionSite]) -> Iterator[FinalInputMeans]:
    """Inside the block, every forward pass adds each site's o_proj input at the final position to the sums."""
    means = FinalInputMeans()

    def hook_for(layer: int):
        def hook(_: nn.Module, args: tuple) -> None:
            x = args[0][:, -1].detach().double().sum(0)  # (H * D,)
            means.sums[layer] = means.sums[layer] + x if layer in means.sums else x
            if layer == sites[0].layer:  # count prompts once per forward pass
                means.count += args[0].shape[0]

        return hook

    handles = [s.o_proj.register_forward_pre_hook(hook_for(s.layer)) for s in sites]
    try:
        yield means
    finally:
        for h in handles:
            h.remove()


@contextmanager
def replace_final_input(site: AttentionSite, columns: slice, value: torch.Tensor) -> Iterator[None]:
    """Inside the block, the o_proj input of ``site`` at the final position has ``value`` in ``columns``."""

    def hook(_: nn.Module, args: tuple) -> tuple:
        x = args[0].clone()  # (B, T, H * D)
        x[:, -1, columns] = value.to(device=x.device, dtype=x.dtype)
        return (x, *args[1:])

    handle = site.o_proj.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# ---- compressors ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Branch:
    """One branch (``K`` or ``V``) of one compressed layer's compressor."""

    layer: int
    name: str
    compressor: Compressor


def gated_branches(
    module: nn.Module, analysis: str, model_name: str = "this model", layers: Optional[Sequence[int]] = None
) -> list[Branch]:
    """Every learned-gate compressor branch of a ckv compressed model (K, then V unless K/V are tied), in
    ``layers`` (default: every layer with learned gates; under a layer schedule each layer's own attention,
    ``ModelConfig.layer_attention``, decides). Raises ``AnalysisNotApplicable`` naming why the model has no learned
    gates, and ``ConfigError`` for ``layers`` that do not exist or have none."""
    if not isinstance(module, Transformer):
        raise AnalysisNotApplicable(
            f"analysis={analysis} needs a ckv model; {model_name} is a "
            f"{type(module).__name__} (gate parameters are unknown)"
        )
    config = module.config
    n = len(module.layers)
    found = {id(m) for m in compressed_layers(module)}
    compressed = {i: b.self_attn for i, b in enumerate(module.layers) if id(b.self_attn) in found}
    if not compressed:
        what = f"attention.kind={config.attention.kind}" if config.layers is None else f"layers {config.layer_kinds}"
        raise AnalysisNotApplicable(
            f"analysis={analysis} needs a compressed model, but {model_name} has no compressor ({what}): there are "
            "no gates"
        )
    gated = [i for i in compressed if config.layer_attention(i).gate is not None]
    if not gated:
        raise AnalysisNotApplicable(
            f"analysis={analysis} needs learned gates, but {model_name} pools by uniform averaging "
            f"(attention.gate=null): every present offset weighs 1/W and there are no gate parameters"
        )
    chosen = gated if layers is None else list(layers)
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise ConfigError(f"layers {bad} do not exist: the model has layers 0..{n - 1}")
    ungated = [i for i in chosen if i not in gated]
    if ungated:
        raise ConfigError(
            f"layers {ungated} have no learned gates (layers {config.layer_kinds}): choose among layers {gated}"
        )
    out = []
    for i in chosen:
        out.extend(Branch(i, name, c) for name, c in compressed[i].compressors().items())
    return out
