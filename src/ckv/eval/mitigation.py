"""Inference-time mitigations of periodic weak spots, no training (docs/mitigation.md): eval.py's ``mitigation``
option group (``conf/eval/mitigation/<name>.yaml``), applied where every task passes, ``ckv.eval.runner.evaluate``.

- ``none``: the model as it is.
- ``shift_ensemble``: every prompt also runs with its target moved by ``s`` positions, for ``shifts`` values of
  ``s`` spread evenly over one stride (``0, S/k, 2S/k, ...``; ``k = S``: every phase), so that a record that
  straddles a window boundary in one run sits inside a window in another. A run moves gap tokens (pads, fillers)
  from one side of the target to the other (``LookupTask.shifted_prompt``): the prompt keeps its length, its query
  position and its group (the target's residue and phase in the unshifted prompt). The runs' last-position
  distributions are combined by ``combine`` (``scoring.combine_runs``): ``mean_logprob`` (the mean of the runs'
  log-probabilities, renormalised: a log-linear pool; its full-vocabulary top-1 is the answer) or
  ``max_confidence`` (the run whose top-1 probability is highest); ``also``: other rules scored from the same runs
  (no more forwards: ``results.also.<rule>`` and a ``correct_<rule>`` column each). Prompt-level: any causal LM,
  ckv or transformers, any task whose groups are the target's position (lookup, needle: ``EvalTask.shift_stride``).
- ``dual_offset``: each compressed layer also pools its windows moved by ``offset`` (null: half its stride) with
  the same trained compressor, and every query attends to both sets of entries in one joint softmax; one forward
  pass, more compressed KV memory. ckv models: ``attention.dual_offset`` (``ckv.attention``) of every compressed
  layer (under a layer schedule each takes half its own stride; a given offset must be under the smallest);
  transformers' DeepSeek-V4: its compressors patched through ckv's copy of each layer
  (``ckv.eval.hf_models.dual_offset_v4``).

A mitigation asked of a model without compressed attention (full attention; a transformers model without
``model.stride`` that is not DeepSeek-V4) runs the model unmitigated and says so in one note. Every setting is
checked from the model's facts before its weights load (``plan_mitigation``). The cost of a mitigated evaluation
against the unmitigated model, for one prompt of the task's length (``mitigation_cost``): prefill FLOPs and KV-cache
bytes by ckv's own accounting for ckv models (``ckv.flops``), and for transformers models FLOPs counted by torch's
FLOP counter on one forward and the KV cache by ``ckv.eval.memory``. The shift ensemble runs its ``k`` prompts
(each as long as the original) as separate sequences: its FLOPs and cache are the sum of theirs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from ckv.attention import CompressedAttentionConfig
from ckv.config import AttentionConfig, ConfigError, ModelConfig, check_choice, check_int, reject_unknown
from ckv.eval.hf_models import DeepseekV4Dual, dual_offset_v4, hf_memory, is_deepseek_v4
from ckv.eval.models import CkvLastLogits, LoadedModel, ModelFacts
from ckv.eval.scoring import COMBINES, LogitsFn, prompt_lengths
from ckv.flops import flops_per_token, kv_bytes_per_token
from ckv.geometry import num_entries
from ckv.model import Transformer

MITIGATIONS = ("none", "shift_ensemble", "dual_offset")
SETTINGS = {"none": (), "shift_ensemble": ("shifts", "combine", "also"), "dual_offset": ("offset",)}
DEFAULT_SHIFTS, DEFAULT_COMBINE = 2, "mean_logprob"


@dataclass(frozen=True)
class MitigationSpec:
    """eval.py's ``mitigation`` group: ``name`` (``MITIGATIONS``) and its settings; ``shift_ensemble``: ``shifts``
    (runs per prompt, their targets moved evenly over one stride; null: 2) and ``combine`` (``COMBINES``; null:
    ``mean_logprob``) and ``also`` (other rules of ``COMBINES`` scored from the same runs; null: none);
    ``dual_offset``: ``offset`` (null: half the stride). A setting of another mitigation is refused (one line
    naming ``mitigation.<field>``)."""

    name: str = "none"
    shifts: Optional[int] = None
    combine: Optional[str] = None
    also: Optional[tuple[str, ...]] = None
    offset: Optional[int] = None

    def __post_init__(self) -> None:
        check_choice("mitigation.name", self.name, MITIGATIONS)
        for key in ("shifts", "combine", "also", "offset"):
            if getattr(self, key) is not None and key not in SETTINGS[self.name]:
                raise ConfigError(
                    f"mitigation.{key} is a setting of "
                    f"{next(n for n, keys in SETTINGS.items() if key in keys)}, not of mitigation={self.name}"
                )
        if self.shifts is not None:
            check_int("mitigation.shifts", self.shifts, 1)
        if self.combine is not None:
            check_choice("mitigation.combine", self.combine, COMBINES)
        if self.offset is not None:
            check_int("mitigation.offset", self.offset, 1)
        if self.name == "shift_ensemble":
            object.__setattr__(self, "shifts", DEFAULT_SHIFTS if self.shifts is None else self.shifts)
            object.__setattr__(self, "combine", self.combine or DEFAULT_COMBINE)
            object.__setattr__(self, "also", self._other_rules())

    def _other_rules(self) -> tuple[str, ...]:
        also = self.also or ()
        if not isinstance(also, (list, tuple)) or not all(isinstance(rule, str) for rule in also):
            raise ConfigError(f"mitigation.also={also!r} must be a list of combine rules, of {list(COMBINES)}")
        for rule in also:
            check_choice("mitigation.also", rule, COMBINES)
        if self.combine in also or len(set(also)) < len(also):
            raise ConfigError(
                f"mitigation.also={list(also)} repeats a rule (the combine rule is {self.combine}): each rule once"
            )
        return tuple(also)

    @classmethod
    def parse(cls, value: Any) -> MitigationSpec:
        """A spec from eval.py's config (a mapping of its fields) or itself; anything else is a ``ConfigError``."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"mitigation={value!r} must be a mapping with a name, one of {list(MITIGATIONS)}")
        reject_unknown(value, [f.name for f in dataclasses.fields(cls)], "mitigation")
        return cls(**value)

    def describe(self) -> dict:
        """The spec's name and the settings it uses (null ones resolved per model by ``plan_mitigation``)."""
        return {"name": self.name, **{key: getattr(self, key) for key in SETTINGS[self.name]}}


def spread_shifts(count: int, stride: int) -> tuple[int, ...]:
    """``count`` shifts of the target spread evenly over one stride: ``(i * stride) // count`` for ``i < count``."""
    return tuple((i * stride) // count for i in range(count))


def ensemble_shifts(spec: MitigationSpec, stride: Optional[int]) -> tuple[tuple[int, ...], str, tuple[str, ...]]:
    """The shift ensemble's shifts over ``stride`` (the task's phase stride), its combine rule and its other rules
    (``also``); ``((), rule, ())`` for any other mitigation (the prompts run once)."""
    if spec.name != "shift_ensemble" or stride is None:
        return (), spec.combine or DEFAULT_COMBINE, ()
    return spread_shifts(spec.shifts, stride), spec.combine, spec.also


@dataclass
class MitigationPlan:
    """What ``plan_mitigation`` decided for one model and task: the ``spec``; ``note`` (set when the model has no
    compressed attention: it runs unmitigated); the shift ensemble's ``shifts`` (the task scores them:
    ``LookupTask.evaluate``); ``config`` (a ckv model's config with ``attention.dual_offset``) or ``offsets``
    (DeepSeek-V4's offset per compressed layer type) for dual-offset compression; ``tokens``: the task's longest
    prompt (0: a task without a prompt list, whose cost is not priced)."""

    spec: MitigationSpec
    tokens: int
    note: Optional[str] = None
    shifts: tuple[int, ...] = ()
    config: Optional[ModelConfig] = None
    offsets: Optional[dict[str, int]] = None

    @property
    def active(self) -> bool:
        """Whether the model runs mitigated."""
        return self.spec.name != "none" and self.note is None

    def apply(self, model: LoadedModel) -> LoadedModel:
        """The model to evaluate: with dual-offset compression a ckv model rebuilt from ``config`` with its weights,
        or a DeepSeek-V4's compressors patched in place; else ``model`` itself."""
        if not self.active or self.spec.name != "dual_offset":
            return model
        if self.config is not None:
            module = Transformer(self.config).to(model.device)
            module.load_state_dict(model.module.state_dict())
            module.eval()
            return dataclasses.replace(model, module=module, logits=CkvLastLogits(module), config=self.config)
        dual_offset_v4(model.module, self.offsets or {})
        return model

    def options(self, options: Any) -> Any:
        """The run options the task runs with: ``options`` itself, or without the mitigation when the model runs
        unmitigated (``note``)."""
        return options if self.active else dataclasses.replace(options, mitigation=MitigationSpec())

    def settings(self) -> dict:
        """The resolved settings: shifts and combine rule, or the offset(s)."""
        if self.spec.name == "shift_ensemble":
            return {"shifts": list(self.shifts), "combine": self.spec.combine, "also": list(self.spec.also)}
        if self.spec.name == "dual_offset" and self.config is not None:
            offsets = {i: a.dual_offset for i, a in _compressed_attention(self.config)}
            one = set(offsets.values())
            return {"offset": one.pop() if len(one) == 1 else {f"layer {i}": o for i, o in offsets.items()}}
        if self.spec.name == "dual_offset":
            return {"offset": self.offsets}
        return {}

    def record(self, cost: Optional[dict] = None) -> dict:
        """``results.mitigation``: the spec, the resolved settings, the note and the cost."""
        return {**self.spec.describe(), "applied": self.active, "settings": self.settings(), "note": self.note,
                "cost": cost}  # fmt: skip


def plan_mitigation(spec: MitigationSpec, kind: Any, model: ModelFacts, built: Any) -> MitigationPlan:
    """Check ``spec`` against the model's facts and the task ``built`` by ``kind`` (its registered ``EvalTask``; no
    weights) and decide what to run; every bad setting is one ``ConfigError`` line: more shifts than the stride, a
    task whose groups are not the target's position, dual-offset compression on a model or attention that cannot
    take it. A model without compressed attention gets a note and runs unmitigated."""
    if spec.name == "none":
        return MitigationPlan(spec, 0)
    prompts = getattr(built, "prompts", None)  # a task without a prompt list: its costs are not priced
    plan = MitigationPlan(spec, int(np.max(prompt_lengths(prompts))) if prompts is not None else 0)
    v4 = model.kind == "hf" and is_deepseek_v4(model.config)
    if model.stride is None and not v4:
        plan.note = (
            f"mitigation={spec.name}: {model.name} has no compressed attention (no stride: full attention, or "
            "model.stride not given), so it has no weak phase to mitigate: the unmitigated result"
        )
        return plan
    if spec.name == "shift_ensemble" and model.stride is None:  # DeepSeek-V4 audited without model.stride
        raise ConfigError("mitigation=shift_ensemble moves targets over the model's stride: give model.stride")
    if spec.name == "shift_ensemble":
        return _plan_shifts(plan, kind, model, built)
    return _plan_dual(plan, model, v4)


def _plan_shifts(plan: MitigationPlan, kind: Any, model: ModelFacts, built: Any) -> MitigationPlan:
    spec, stride = plan.spec, kind.shift_stride(built)
    if stride is None:
        raise ConfigError(
            f"mitigation=shift_ensemble moves each prompt's target across the phases, but task kind {kind.kind!r} "
            "does not group prompts by the target's position; use it with the lookup or the needle (or "
            "mitigation=dual_offset)"
        )
    if spec.shifts > stride:
        raise ConfigError(
            f"mitigation.shifts={spec.shifts} is more than the model's stride {stride}: the shifts are spread over "
            f"one stride (at most one per phase); use 1..{stride}"
        )
    plan.shifts = spread_shifts(spec.shifts, stride)
    return plan


def _plan_dual(plan: MitigationPlan, model: ModelFacts, v4: bool) -> MitigationPlan:
    offset = plan.spec.offset
    if v4:
        plan.offsets = _v4_offsets(model.config, offset, plan.tokens)
        return plan
    if model.kind != "ckv" or not isinstance(model.config, ModelConfig):
        raise ConfigError(
            f"mitigation=dual_offset pools a second set of windows inside compressed attention: ckv's models and "
            f"transformers' DeepSeek-V4 have it, {model.name} ({model.info.get('architecture', model.kind)}) does "
            "not; use mitigation=shift_ensemble"
        )
    strides = sorted({a.stride for _, a in _compressed_attention(model.config)})
    which = f"the model's stride {strides[0]}" if len(strides) == 1 else f"its smallest layer stride {strides[0]}"
    if (strides[0] // 2 if offset is None else offset) < 1:
        raise ConfigError(f"mitigation=dual_offset: {which} leaves no offset between windows")
    if offset is not None and offset >= strides[0]:
        raise ConfigError(f"mitigation.offset={offset} must be < {which}")

    def dual(a: AttentionConfig) -> AttentionConfig:
        if not isinstance(a, CompressedAttentionConfig):
            return a
        return dataclasses.replace(a, dual_offset=a.stride // 2 if offset is None else offset)

    plan.config = model.config.map_attention(dual)
    return plan


def _compressed_attention(config: ModelConfig) -> list[tuple[int, CompressedAttentionConfig]]:
    """The compressed layers of ``config`` (index, the layer's attention: ``ModelConfig.layer_attention``), in
    order; every layer of a uniform compressed stack, those of a layer schedule's compressed segments."""
    layers = [(i, config.layer_attention(i)) for i in range(config.n_layers)]
    return [(i, a) for i, a in layers if isinstance(a, CompressedAttentionConfig)]


def _v4_offsets(config: Any, offset: Optional[int], tokens: int) -> dict[str, int]:
    """DeepSeek-V4's offset per compressed layer type (null: half its rate), refusing top-k selection that binds at
    ``tokens`` (the moved entries are attended densely, beside the indexer's picks) and an offset not under a
    layer's rate."""
    rates = {t: r for t, r in dict(config.compress_rates).items() if t in set(config.layer_types)}
    out = {}
    for kind, rate in rates.items():
        o = rate // 2 if offset is None else offset
        if not 1 <= o < rate:
            raise ConfigError(f"mitigation.offset={o} must be between 1 and the {kind} layers' rate {rate} - 1")
        out[kind] = o
    topk, csa = int(config.index_topk), rates.get("compressed_sparse_attention")
    if csa and num_entries(tokens, csa) > topk:
        raise ConfigError(
            f"mitigation=dual_offset on DeepSeek-V4 needs dense selection: prompts of {tokens} tokens have "
            f"{num_entries(tokens, csa)} compressed entries per CSA layer but index_topk is {topk} (the moved entries "
            "would be attended beside a top-k of the others); use shorter prompts or mitigation=shift_ensemble"
        )
    if getattr(config, "_attn_implementation", None) not in (None, "eager"):
        raise ConfigError(
            f"mitigation=dual_offset on DeepSeek-V4 needs its eager attention (the compressors' block mask), "
            f"not {config._attn_implementation}"
        )
    return out


# ---- cost ---------------------------------------------------------------------------------------------------------
def ckv_prefill(config: ModelConfig, tokens: int) -> tuple[float, float]:
    """Forward FLOPs and KV-cache bytes (bf16) of one prefill of ``tokens`` tokens by ckv's accounting
    (``ckv.flops.flops_per_token``, ``kv_bytes_per_token``)."""
    return flops_per_token(config, tokens).forward * tokens, kv_bytes_per_token(config, tokens) * tokens


def counted_flops(logits: LogitsFn, prompt: np.ndarray, device: Any) -> float:
    """FLOPs of one call of ``logits`` on ``prompt`` (batch 1), counted by torch's ``FlopCounterMode`` (the
    matrix products the model's code runs: for a transformers model, where ckv has no accounting of its code)."""
    ids = torch.as_tensor(np.asarray(prompt), device=device)[None]  # (1, T)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        logits(ids)
    return float(counter.get_total_flops())


def _hf_cache(model: LoadedModel, tokens: int, offsets: Optional[dict[str, int]]) -> float:
    """KV-cache bytes of one sequence of ``tokens`` tokens (``ckv.eval.memory``), with dual-offset compression's
    moved entries when ``offsets`` are given."""
    memory = hf_memory(model, model.module, dual_offsets=offsets)
    return sum(g.count * g.cache(tokens) for g in memory.layers)


def _ratios(flops: float, base_flops: float, kv: float, base_kv: float, tokens: int, by: str) -> dict:
    return {
        "tokens": tokens,
        "prefill_flops": flops,
        "prefill_flops_unmitigated": base_flops,
        "flops_ratio": flops / base_flops,
        "kv_bytes": kv,
        "kv_bytes_unmitigated": base_kv,
        "kv_ratio": kv / base_kv,
        "counted_by": by,
    }


def config_cost(plan: MitigationPlan, config: ModelConfig) -> Optional[dict]:
    """The cost of ``plan`` on a ckv model of ``config`` for one prompt of ``plan.tokens`` tokens, from ckv's
    accounting alone (no weights; ``None`` when nothing is applied): the shift ensemble's prefills at each
    shifted length, or the dual-offset model's prefill, against the unmitigated prefill."""
    if not plan.active or not plan.tokens:
        return None
    T = plan.tokens
    base_flops, base_kv = ckv_prefill(config, T)
    if plan.spec.name == "shift_ensemble":  # k prompts of T tokens each
        flops, kv = len(plan.shifts) * base_flops, len(plan.shifts) * base_kv
    else:
        flops, kv = ckv_prefill(plan.config, T)
    by = "ckv.flops (flops_per_token, kv_bytes_per_token at bf16)"
    return _ratios(flops, base_flops, kv, base_kv, T, by)


def mitigation_cost(plan: MitigationPlan, model: LoadedModel, built: Any, logits: LogitsFn) -> Optional[dict]:
    """The cost of ``plan`` for one prompt of the task (``config_cost`` for ckv models; for a transformers model the
    FLOPs of ``logits`` on the task's first prompt counted by torch, with dual-offset compression switched off and
    on, and the KV cache by ``ckv.eval.memory``)."""
    if not plan.active or not plan.tokens:
        return None
    if model.kind == "ckv":
        return config_cost(plan, model.config)
    prompt, T = built.prompts[0], plan.tokens
    with DeepseekV4Dual.off(model.module):
        base_flops = counted_flops(logits, prompt, model.device)
    base_kv = _hf_cache(model, T, None)
    if plan.spec.name == "shift_ensemble":  # k prompts of T tokens each
        flops, kv = len(plan.shifts) * base_flops, len(plan.shifts) * base_kv
    else:
        flops, kv = counted_flops(logits, prompt, model.device), _hf_cache(model, T, plan.offsets)
    return _ratios(flops, base_flops, kv, base_kv, T, "torch FlopCounterMode on one prompt; ckv.eval.memory (cache)")


def cost_line(record: dict) -> str:
    """The summary's line of ``results.mitigation``."""
    if record.get("note"):
        return record["note"]
    head = f"mitigation {record['name']}"
    settings = ", ".join(f"{k} {v}" for k, v in (record.get("settings") or {}).items())
    cost = record.get("cost")
    if not cost:
        return f"{head} ({settings})"
    return (
        f"{head} ({settings}): prefill FLOPs {cost['flops_ratio']:.3f}x and KV cache {cost['kv_ratio']:.3f}x the "
        f"unmitigated model's, per prompt of {cost['tokens']} tokens ({cost['counted_by']})"
    )
