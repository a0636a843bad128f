"""Knock-out (mean ablation): which layers and KV-head groups serve which phases (``eval.py analysis=knockout``).

For every layer, and every KV-head group within a layer, the attention output at the final query position (the
last prompt token, whose logits the lookup task scores) is replaced by its mean over a calibration set of lookup
prompts disjoint from the scored ones; the same scored prompts are then re-evaluated. Per phase the effect is
``100 * (knocked - clean) / clean`` (percent of the clean accuracy), with a paired cluster-bootstrap interval
(the same resampled key->value mappings for clean and knocked). In the paper's units: the effect per residue
(target position mod the task's modulus M, 24 in the paper's protocol) and, per phase, the paper's fold of it
(the mean of the relative changes of the residues ``p, p + S, ...``), as a layer x KV head x residue table; the
per-prompt outcomes go to ``knockout_prompts.csv`` (``table_from_prompts`` rebuilds the table). Works for any
model whose attention output projections ``ckv.analysis.hooks.attention_sites`` finds (ckv full and compressed
models, Qwen-like HF models).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ckv.analysis.hooks import (
    AttentionSite,
    FinalInputMeans,
    attention_sites,
    capture_final_inputs,
    replace_final_input,
    settings_from_params,
)
from ckv.analysis.paired import interval, paired_replicates, relative_change
from ckv.analysis.plots import plot_knockout
from ckv.analysis.registry import AnalysisContext, register_analysis
from ckv.config import ConfigError
from ckv.eval.lookup import LookupOutcome, LookupTask
from ckv.eval.scoring import score_next_token
from ckv.eval.stats import group_accuracy, with_cluster_intervals
from ckv.geometry import phase
from ckv.io.results import read_int_columns, write_csv

log = logging.getLogger(__name__)
UNIT_KINDS = ("layers", "heads")


@dataclass(frozen=True)
class KnockoutSettings:
    """``calibration``: base examples of the calibration set (each at every shift, like the scored prompts);
    ``calibration_seed``: its task seed (default: the scored task's seed + 1, so its key->value mappings are
    drawn independently; any prompt that still equals a scored one is dropped); ``units``: ``layers`` (the whole
    attention output of a layer) and/or ``heads`` (one KV-head group: the query heads sharing a KV head)."""

    calibration: int = 64
    calibration_seed: Optional[int] = None
    units: tuple[str, ...] = UNIT_KINDS

    def __post_init__(self) -> None:
        if isinstance(self.units, str):  # units: heads
            object.__setattr__(self, "units", (self.units,))
        if not isinstance(self.calibration, int) or isinstance(self.calibration, bool) or self.calibration < 1:
            raise ConfigError(f"analysis.calibration={self.calibration!r} must be an integer >= 1 (base examples)")
        if self.calibration_seed is not None and (
            not isinstance(self.calibration_seed, int) or self.calibration_seed < 0
        ):
            raise ConfigError(f"analysis.calibration_seed={self.calibration_seed!r} must be null or an integer >= 0")
        bad = [u for u in self.units if u not in UNIT_KINDS]
        if bad or not self.units:
            raise ConfigError(f"analysis.units={list(self.units)!r} must be a non-empty subset of {list(UNIT_KINDS)}")


@dataclass(frozen=True)
class Unit:
    """What one knock-out replaces: columns ``[start, stop)`` of layer ``layer``'s o_proj input (query heads
    ``heads``); ``kv_head`` is the KV-head group, or ``None`` for the whole layer."""

    layer: int
    kv_head: Optional[int]
    heads: tuple[int, ...]
    start: int
    stop: int

    @property
    def label(self) -> str:
        return f"L{self.layer}" if self.kv_head is None else f"L{self.layer} kv{self.kv_head}"


def knockout_units(sites: list[AttentionSite], kinds: tuple[str, ...]) -> list[Unit]:
    """Layer units (all heads) and/or KV-head-group units of every site, layers in order."""
    units = []
    for s in sites:
        if "layers" in kinds:
            units.append(Unit(s.layer, None, tuple(range(s.n_heads)), 0, s.width))
        if "heads" in kinds:
            for g in range(s.kv_heads):
                cols = s.group_columns(g)
                units.append(Unit(s.layer, g, tuple(s.group_heads(g)), cols.start, cols.stop))
    return units


def calibration_means(
    ctx: AnalysisContext, sites: list[AttentionSite], settings: KnockoutSettings
) -> tuple[FinalInputMeans, dict]:
    """Mean attention output of every layer at the final position over the calibration prompts (a lookup task
    with another seed, the scored prompts removed). Returns the means and a description of the set."""
    spec = ctx.task.spec
    seed = spec.seed + 1 if settings.calibration_seed is None else settings.calibration_seed
    calib = LookupTask(
        dataclasses.replace(spec, seed=seed, n_base=settings.calibration),
        ctx.task.codec,
        max_len=ctx.model.max_len,
        model_stride=ctx.model.stride,
        training=ctx.model.lookup,
    )
    scored = {p.tobytes() for p in ctx.task.prompts}
    keep = [i for i, p in enumerate(calib.prompts) if p.tobytes() not in scored]
    if not keep:
        raise ConfigError("every calibration prompt equals a scored prompt: change analysis.calibration_seed")
    answers = calib.table["answer_id"][keep]
    with capture_final_inputs(sites) as means:
        scores = score_next_token(
            ctx.model.logits,
            [calib.prompts[i] for i in keep],
            answers[:, None],
            batch_size=ctx.options.batch_size,
            device=ctx.model.device,
            progress=ctx.options.progress,
            desc="calibration",
        )
    info = {
        "n_base": settings.calibration,
        "seed": seed,
        "n_prompts": len(keep),
        "dropped_as_scored": len(calib.prompts) - len(keep),
        "accuracy": float(np.mean(scores.top1 == answers)),
    }
    return means, info


def _flat(prefix: str, iv: dict) -> dict:
    return {prefix: iv["value"], f"{prefix}_lower": iv["lower"], f"{prefix}_upper": iv["upper"]}


def fold_to_phases(residue_values: np.ndarray, stride: int) -> np.ndarray:
    """(..., M) -> (..., S): the paper's fold of a per-residue value to phase: the mean over the residues
    ``r = p, p + S, ...`` of phase ``p`` (``M`` a multiple of ``S``); NaN where any of them is NaN."""
    m = residue_values.shape[-1]
    return residue_values.reshape(*residue_values.shape[:-1], m // stride, stride).mean(-2)


def knockout_effects(ctx: AnalysisContext, clean: LookupOutcome, knocked: list[np.ndarray]) -> list[dict]:
    """Per knocked outcome: the overall and per-phase effect ``100 * (knocked - clean) / clean`` and difference
    ``knocked - clean`` (accuracy fractions), each with a paired cluster-bootstrap interval, and the knocked
    per-phase accuracy with its cluster-bootstrap interval (over key->value mappings; ``interval`` names it);
    the effect per residue mod the task's modulus M and, per phase, the paper's fold of it (``folded_effect``:
    the mean of the residues' relative changes), with paired intervals."""
    t, S, opts = clean.table, ctx.task.require_stride("analysis=knockout"), ctx.options.stats
    M = ctx.task.modulus
    outcomes = [clean.correct, *knocked]
    reps = paired_replicates(outcomes, t["phase"], S, t["base"], opts)  # (R, 1 + U, S)
    reps_all = paired_replicates(outcomes, np.zeros_like(t["phase"]), 1, t["base"], opts)[..., 0]  # (R, 1 + U)
    reps_res = paired_replicates(outcomes, t["residue"], M, t["base"], opts)  # (R, 1 + U, M)
    acc = [
        with_cluster_intervals(group_accuracy(o, t["phase"], S), reps[:, i], opts.level) for i, o in enumerate(outcomes)
    ]
    res_acc = np.stack([group_accuracy(o, t["residue"], M).accuracy for o in outcomes])  # (1 + U, M)
    means = [float(np.mean(o)) for o in outcomes]
    out = []
    for u in range(1, len(outcomes)):
        res_effect = relative_change(res_acc[0], res_acc[u])  # (M,)
        res_boot = relative_change(reps_res[:, 0], reps_res[:, u])  # (R, M)
        folded, folded_boot = fold_to_phases(res_effect, S), fold_to_phases(res_boot, S)
        phases = []
        for r in range(S):
            c, k = acc[0].accuracy[r], acc[u].accuracy[r]
            phases.append(
                {
                    "phase": r,
                    "clean": float(c),
                    "knocked": float(k),
                    "knocked_lower": float(acc[u].lower[r]),
                    "knocked_upper": float(acc[u].upper[r]),
                    "knocked_interval": acc[u].interval,
                    **_flat(
                        "effect",
                        interval(relative_change(reps[:, 0, r], reps[:, u, r]), relative_change(c, k), opts.level),
                    ),
                    **_flat("delta", interval(reps[:, u, r] - reps[:, 0, r], k - c, opts.level)),
                    **_flat("folded_effect", interval(folded_boot[:, r], folded[r], opts.level)),
                }
            )
        residues = [
            {
                "residue": r,
                "phase": phase(r, S),
                "clean": float(res_acc[0, r]),
                "knocked": float(res_acc[u, r]),
                **_flat("effect", interval(res_boot[:, r], res_effect[r], opts.level)),
            }
            for r in range(M)
        ]
        out.append(
            {
                "clean_mean": means[0],
                "knocked_mean": means[u],
                **_flat(
                    "effect",
                    interval(
                        relative_change(reps_all[:, 0], reps_all[:, u]), relative_change(means[0], means[u]), opts.level
                    ),
                ),
                **_flat("delta", interval(reps_all[:, u] - reps_all[:, 0], means[u] - means[0], opts.level)),
                "phases": phases,
                "residues": residues,
            }
        )
    return out


PROMPTS_FILE = "knockout_prompts.csv"
PROMPT_COLUMNS = ("base", "shift", "target_position", "residue", "phase")


def prompt_rows(clean: LookupOutcome, units: list[Unit], knocked: list[np.ndarray]) -> list[dict]:
    """One row per scored prompt: ``PROMPT_COLUMNS`` of the task's table, ``clean`` (0/1 correct) and one 0/1
    column per unit (named by its label)."""
    cols = {c: clean.table[c] for c in PROMPT_COLUMNS} | {"clean": clean.correct}
    cols |= {u.label: k for u, k in zip(units, knocked)}
    return [{c: int(v[i]) for c, v in cols.items()} for i in range(len(clean.correct))]


def _jsonable(rows: np.ndarray) -> list[list[Optional[float]]]:
    return [[float(x) if np.isfinite(x) else None for x in row] for row in rows]


def effect_table(units: list[dict], residue_effect: np.ndarray, stride: int) -> Optional[dict]:
    """The paper's knock-out table from the units (dicts with ``layer`` and ``kv_head``, in order) and their
    per-residue effects ``residue_effect`` (U, M) (NaN: undefined), KV-group units only: ``residue_effect``
    (layer x KV head x M) and ``phase_effect`` (layer x KV head x S, the paper's fold). ``None`` without
    KV-group units (``analysis.units`` without ``heads``)."""
    table: dict[int, list[np.ndarray]] = {}
    for u, e in zip(units, residue_effect):
        if u["kv_head"] is not None:
            table.setdefault(u["layer"], []).append(e)
    if not table:
        return None
    per_layer = [np.stack(heads) for _, heads in sorted(table.items())]  # each (KV, M)
    return {
        "layers": sorted(table),
        "shape": "layer x KV head x residue (phase_effect: x phase)",
        "residue_effect": [_jsonable(a) for a in per_layer],
        "phase_effect": [_jsonable(fold_to_phases(a, stride)) for a in per_layer],
    }


def table_from_prompts(result: dict, path: Path) -> Optional[dict]:
    """Rebuild ``result["table"]`` of a knock-out result from its per-prompt file ``path`` (``PROMPTS_FILE``)."""
    labels = [u["label"] for u in result["units"]]
    cols = read_int_columns(path, ("residue", "clean", *labels))

    def accuracy(column: str) -> np.ndarray:
        return group_accuracy(cols[column], cols["residue"], result["modulus"]).accuracy

    clean = accuracy("clean")
    effects = np.stack([relative_change(clean, accuracy(label)) for label in labels])
    return effect_table(result["units"], effects, result["stride"])


def run_knockout(ctx: AnalysisContext, settings: KnockoutSettings) -> dict:
    """Knock out every unit of ``settings.units`` and measure its per-phase and per-residue effect (see the module
    docstring); writes the per-prompt outcomes to ``<out>/knockout_prompts.csv``. Returns the JSON-ready result:
    ``stride``, ``modulus``, ``calibration``, ``clean`` (per-phase report), ``units``, ``table`` (the paper's
    layer x KV head x residue table and its phase fold), ``prompts`` (the per-prompt file's name)."""
    stride = ctx.task.require_stride("analysis=knockout")  # a full-attention model: the comparison's task.stride
    sites = attention_sites(ctx.model.module)
    means, calibration = calibration_means(ctx, sites, settings)
    clean = ctx.evaluate()
    units = knockout_units(sites, settings.units)
    done: dict[tuple[int, int, int], np.ndarray] = {}  # a KV group of a 1-KV-head layer is the whole layer
    knocked = []
    for i, u in enumerate(units):
        key = (u.layer, u.start, u.stop)
        if key not in done:
            log.info("knock-out %d/%d: %s", i + 1, len(units), u.label)
            cols = slice(u.start, u.stop)
            with replace_final_input(sites[u.layer], cols, means.mean(u.layer)[cols]):
                done[key] = ctx.evaluate().correct
        knocked.append(done[key])
    effects = knockout_effects(ctx, clean, knocked)
    write_csv(ctx.out_dir / PROMPTS_FILE, prompt_rows(clean, units, knocked))
    report = ctx.report(clean)
    rows = [
        {"layer": u.layer, "kv_head": u.kv_head, "heads": list(u.heads), "label": u.label, **e}
        for u, e in zip(units, effects)
    ]
    residue_effects = np.array([[np.nan if r["effect"] is None else r["effect"] for r in u["residues"]] for u in rows])
    return {
        "stride": stride,
        "modulus": ctx.task.modulus,
        "position": "final query position (the last prompt token, whose logits are scored)",
        "calibration": calibration,
        "clean": {"headline": report["headline"], "phase": report["phase"]},
        "units": rows,
        "table": effect_table(rows, residue_effects, stride),
        "prompts": PROMPTS_FILE,
    }


def knockout_rows(result: dict) -> list[dict]:
    """One CSV row per unit and phase."""
    return [{"layer": u["layer"], "kv_head": u["kv_head"], **p} for u in result["units"] for p in u["phases"]]


@register_analysis("knockout")
def knockout(ctx: AnalysisContext) -> dict:
    """``eval.py analysis=knockout``: the result, ``knockout.csv`` and heatmaps (layers x phases, heads x phases)."""
    result = run_knockout(ctx, settings_from_params(KnockoutSettings, ctx.params, "knockout"))
    write_csv(ctx.out_dir / "knockout.csv", knockout_rows(result))
    if ctx.options.plots:
        result["plots"] = [p.name for p in plot_knockout(result, ctx.out_dir, ctx.model.name)]
    return result
