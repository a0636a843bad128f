"""``make robust``'s crowding analysis: ``eval.py analysis=joint`` on the compressed models of the study's
``analysed_tasks`` (conf/study/robust.yaml), one summary per run, and its printed lines."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckv.apps.study_config import Study
from ckv.apps.study_run import QUICK_EVAL, Timer, run_command
from ckv.io.layout import analysis_file, eval_dir
from ckv.io.results import read_json


def analysed_tasks(study: Study) -> tuple[str, ...]:
    """The tasks whose compressed models the crowding analysis runs on (``params.analysed_tasks``)."""
    return tuple(study.params["analysed_tasks"])


def analyse(
    done: list[dict], study: Study, out: Path, quick: bool, workers: int, env: dict, clock: Timer
) -> list[dict]:
    """The crowding analysis on the compressed models of ``study``'s ``analysed_tasks``, on its task with
    ``params.analysis_n_base`` base examples: ``eval.py analysis=joint`` (per layer and KV
    head, the knock-out effect per phase beside the K and V gate profiles, docs/analysis.md), one summary per run.
    ``static`` is the effective number of offsets of the window-averaged gate (1 = one offset, W = uniform)."""
    todo = [d for d in done if d["run"].name.split("_", 1)[0] in analysed_tasks(study) and d["run"].role != "control"]

    def one(d: dict) -> dict:
        run_command(
            [
                sys.executable,
                "eval.py",
                f"model.path='{d['dir']}'",
                f"task={study.task}",
                "analysis=joint",
                "progress=false",
                *(QUICK_EVAL if quick else (f"task.n_base={study.params['analysis_n_base']}",)),
            ],
            out / "logs" / f"joint_{d['run'].name}_seed{d['run'].seed}.log",
            env,
        )
        path = analysis_file(eval_dir(d["dir"], study.task), "joint")
        res = read_json(path)["analysis"]["results"]
        print(f"[{clock}] {d['run'].label}: crowding analysis done", flush=True)
        return {
            "label": d["run"].label,
            "window": res["window"],
            "stride": res["stride"],
            "worst_phase": res["clean"]["worst_phase"],
            "layers": [
                {
                    k: u.get(k)
                    for k in (
                        "layer",
                        "kv_head",
                        "k_static",
                        "v_static",
                        "k_peak",
                        "v_peak",
                        "worst_phase",
                        "loss_vs_k",
                        "loss_vs_v",
                        "knockout",
                    )
                }
                for u in res["rows"]
            ],
            "file": str(path),
        }

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, todo))


def crowding_lines(analyses: list[dict]) -> list[str]:
    """One line per analysed run and layer: gate concentration (static effective offsets of W, K and V, with
    peaks) and the knock-out of the layer's KV head per phase (``100 * (knocked - clean) / clean``, the analysis'
    relative effect), with the phase it hurts most."""
    lines = []
    for a in analyses:
        for u in a["layers"]:
            ko = " / ".join("-" if e is None else f"{e:+.0f}" for e in u["knockout"])
            v = "" if u["v_static"] is None else f", V {u['v_static']:.1f} (peak {u['v_peak']})"
            lines.append(
                f"{a['label']} L{u['layer']} kv{u['kv_head']}: static offsets of W={a['window']}: "
                f"K {u['k_static']:.1f} (peak {u['k_peak']}){v}; "
                f"knock-out effect per phase (% change of accuracy) {ko}, "
                f"most hurt phase {u['worst_phase']}; clean worst phase {a['worst_phase']}"
            )
    return lines
