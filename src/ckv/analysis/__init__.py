"""Mechanistic analyses of trained models: knock-outs, gate concentration, gate cycling, the joint view, selection.

They build on evaluation (the same prompts and statistics) and install their own hooks on the model; model code
carries no analysis state. Importing the package registers every shipped analysis (see ``registry``)::

    from ckv.analysis import run_analysis
    env = run_analysis({"name": "knockout", "calibration": 32}, model, LookupSpec(modulus=4))
"""

from ckv.analysis.registry import ANALYSES, AnalysisContext, AnalysisFn, register_analysis, run_analysis

# the shipped analyses register themselves when imported; the registry above exists by then
from ckv.analysis import gate_cycling, gates, joint_view, knockout, selection  # noqa: F401  isort: skip

__all__ = ["ANALYSES", "AnalysisContext", "AnalysisFn", "register_analysis", "run_analysis"]
