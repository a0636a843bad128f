"""Joint view: each layer's KV heads with their knock-out profile beside their gate profiles
(``eval.py analysis=joint``).

The paper's observation is that they line up: a head whose gates concentrate on some offsets loses accuracy,
when knocked out, on the matching phases. For each (layer, KV head) this runs the KV-group knock-out
(``ckv.analysis.knockout``) and the gate statistics (``ckv.analysis.gates``) on the same prompts and puts side by side
the per-phase knock-out effect and the K and V offset profiles, and in the paper's units (its Figure 4): the
knock-out folded from residues to phases and the gate profiles per phase (offsets folded to the phases of their
tokens, so any W >= S; the value gate rolled by -1), with the Pearson correlation between the knock-out loss
profile (minus the folded effect) and each phase profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ckv.analysis.gates import gate_statistics
from ckv.analysis.hooks import settings_from_params
from ckv.analysis.knockout import KnockoutSettings, run_knockout
from ckv.analysis.plots import plot_joint
from ckv.analysis.registry import AnalysisContext, register_analysis


@dataclass(frozen=True)
class JointSettings:
    """Calibration set of the knock-out (see ``KnockoutSettings``)."""

    calibration: int = 64
    calibration_seed: Optional[int] = None


def correlation(a: list[Optional[float]], b: list[float]) -> Optional[float]:
    """Pearson correlation of two profiles; ``None`` when a value is missing or either profile is flat."""
    if len(a) != len(b) or any(x is None for x in a):
        return None
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / denom) if denom > 1e-12 else None


def at_stride(profile: list[float], stride: int) -> Optional[list[float]]:
    """A layer's phase profile (its own stride's entries) at the knock-out's ``stride``: itself, or repeated when
    ``stride`` is a multiple of the layer's (a layer schedule's phase stride is the least common multiple of its
    layers' strides: a position's phase mod a layer's stride is its phase mod ``stride``, mod the layer's); None
    when ``stride`` is not a multiple of it."""
    if stride % len(profile):
        return None
    return list(profile) * (stride // len(profile))


def joint_rows(knockout: dict, gates: list[dict]) -> list[dict]:
    """One row per (layer, KV head): knock-out effect per phase (``knockout``, of the phase's accuracy, with
    interval) and the paper's fold of it (``knockout_folded``, with interval), worst phase, K and V offset profiles
    and peaks, their phase profiles (the paper's ``g(r)``, V rolled by -1; folded when W > S; ``at_stride``) and the
    correlations of the loss profile (minus the folded effect) with each phase profile."""
    by = {(g["layer"], g["kv_head"], g["branch"]): g for g in gates}
    rows = []
    for u in knockout["units"]:
        effect = [p["effect"] for p in u["phases"]]
        folded = [p["folded_effect"] for p in u["phases"]]
        finite = [(e, r) for r, e in enumerate(effect) if e is not None]
        row = {
            "layer": u["layer"],
            "kv_head": u["kv_head"],
            "knockout": effect,
            "knockout_lower": [p["effect_lower"] for p in u["phases"]],
            "knockout_upper": [p["effect_upper"] for p in u["phases"]],
            "knockout_folded": folded,
            "knockout_folded_lower": [p["folded_effect_lower"] for p in u["phases"]],
            "knockout_folded_upper": [p["folded_effect_upper"] for p in u["phases"]],
            "worst_phase": min(finite)[1] if finite else None,
        }
        loss = [None if e is None else -e for e in folded]
        for branch in ("K", "V"):
            g = by.get((u["layer"], u["kv_head"], branch))
            key = branch.lower()
            profile = None if g is None else at_stride(g["phase_profile"], len(folded))
            row[f"{key}_profile"] = None if g is None else g["profile"]
            row[f"{key}_phase_profile"] = profile
            row[f"{key}_peak"] = None if g is None else g["peak_offset"]
            row[f"{key}_static"] = None if g is None else g["static"]
            row[f"loss_vs_{key}"] = None if profile is None else correlation(loss, profile)
        rows.append(row)
    return rows


@register_analysis("joint")
def joint(ctx: AnalysisContext) -> dict:
    """``eval.py analysis=joint``: knock-out (per KV-head group) and gate profiles per layer/head, side by side."""
    settings = settings_from_params(JointSettings, ctx.params, "joint")
    gates, _ = gate_statistics(ctx.model, ctx.task, ctx.options)  # first: fails fast on models without gates
    knockout = run_knockout(ctx, KnockoutSettings(settings.calibration, settings.calibration_seed, ("heads",)))
    config = ctx.model.module.config
    window = max(config.layer_attention(g["layer"]).window for g in gates)  # a layer schedule's: the largest
    result = {
        "stride": ctx.task.stride,
        "window": window,
        "calibration": knockout["calibration"],
        "clean": knockout["clean"]["headline"],
        "modulus": knockout["modulus"],
        "rows": joint_rows(knockout, gates),
    }
    if ctx.options.plots:
        result["plots"] = [plot_joint(result, ctx.out_dir / "joint.png", ctx.model.name).name]
    return result
