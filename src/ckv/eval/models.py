"""Models as evaluation sees them: a last-position logits callable plus what the tasks need to know about it.

``load_ckv_model`` reads ckv weights (a run folder, its final ``model/`` or any checkpoint's ``weights/``) and
the run's ``config.yaml`` (the lookup layout it trained on, and a check that the weights match the run).
``ckv.eval.hf_models.load_hf_model`` does the same for any local transformers causal LM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer

from ckv.attention import model_phase_stride
from ckv.config import ConfigError, ModelConfig, ModelSpec, saved_attention
from ckv.data import lookup_format_for
from ckv.data.config import DataConfig, LookupConfig
from ckv.data.lookup import LookupFormat
from ckv.data.tokenizer import TextTokenizer, TokenizersTokenizer
from ckv.device import resolve_device
from ckv.eval.scoring import LogitsFn
from ckv.io.layout import (
    EVAL_DIR,
    MODEL_DIR,
    STATE_FILE,
    TOKENIZER_FILE,
    WEIGHTS_DIR,
    CheckpointError,
    damaged,
    is_run_dir,
    latest_checkpoint,
    list_checkpoints,
    read_json_file,
    read_run_config,
    read_text,
)
from ckv.io.weights import WEIGHTS_CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_FIX, is_weights_dir, load_config, load_weights
from ckv.model import Transformer

PathLike = Union[str, Path]


class CheckpointMismatchError(ConfigError):
    """Weights that do not match their config, their run, or the task's layout."""


@dataclass(kw_only=True)
class ModelFacts:
    """What tasks need to know about a model, read without its weights (a run's config, a transformers folder's
    config.json and tokenizer), so that every task setting is checked before the weights load.

    ``max_len``: the longest prompt it accepts; ``stride``: its compression stride (``None`` for full attention or
    an HF model without ``model.stride``); ``lookup``/``lookup_format``: the lookup settings and id layout its run
    trained on, if any; ``eval_words``: the keys, values and pad a pretraining run held out for the lookup evaluation
    (``data.recall.eval_keys`` / ``eval_values`` / ``eval_pad``, its end-of-document token as ``bos``), if any;
    ``out_dir``: where results go by default; ``info``: a JSON description; ``kind``: ``ckv`` or ``hf``;
    ``config``: the model's config (``ckv.config.ModelConfig``, or the transformers config object); ``dtype``: the
    compute dtype it runs in; ``trust_remote_code``: whether its transformers code may run.
    """

    name: str
    vocab_size: int
    max_len: int
    stride: Optional[int] = None
    tokenizer: Optional[TextTokenizer] = None
    lookup: Optional[LookupConfig] = None
    lookup_format: Optional[LookupFormat] = None
    eval_words: Optional[dict[str, Any]] = None
    out_dir: Optional[Path] = None
    info: dict = field(default_factory=dict)
    kind: str = "ckv"
    config: Any = None
    dtype: torch.dtype = torch.float32
    trust_remote_code: bool = False


@dataclass(kw_only=True)
class LoadedModel(ModelFacts):
    """A model ready for evaluation: its ``ModelFacts`` plus ``logits`` (``input_ids (B, T) -> (B, V)`` logits at
    the last position), ``module`` (the underlying ``nn.Module``: analyses hook into it) and ``device``."""

    logits: LogitsFn
    module: torch.nn.Module
    device: torch.device


class CkvLastLogits:
    """Last-position logits of a ckv ``Transformer``: the LM head runs on one position only."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.hidden_states(input_ids)[:, -1])  # (B, V)


def find_weights(path: PathLike, step: Union[int, str, None] = None) -> tuple[Path, Optional[Path]]:
    """``(weights_dir, run_dir)`` for a run folder or a weights folder.

    For a run folder (``ckv.io.layout.is_run_dir``), ``step=None`` takes ``model/`` (else the latest checkpoint),
    ``"latest"`` the latest checkpoint, an integer that checkpoint. A weights folder inside a run finds its run
    (for ``config.yaml``).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model.path={str(p)!r} does not exist")
    if is_weights_dir(p):
        if step is not None:
            raise ConfigError(f"model.step={step!r} is for run folders; {p} is already a weights folder")
        return p, next((a for a in list(p.parents)[:3] if is_run_dir(a)), None)
    if not is_run_dir(p):
        raise FileNotFoundError(
            f"{p} is neither a ckv run folder (config.yaml with model/ or checkpoints/) nor a "
            f"weights folder ({WEIGHTS_CONFIG_FILE} + {WEIGHTS_FILE})"
        )
    if step is None and is_weights_dir(p / MODEL_DIR):
        return p / MODEL_DIR, p
    if step is None or step == "latest":
        ckpt = latest_checkpoint(p)
        if ckpt is None:
            raise FileNotFoundError(f"run {p} has neither {MODEL_DIR}/ weights nor a complete checkpoint")
    else:
        found = dict(list_checkpoints(p))
        if not isinstance(step, int) or step not in found:
            raise FileNotFoundError(f"model.step={step!r}: run {p} has checkpoints at steps {sorted(found)}")
        ckpt = found[step]
    if not is_weights_dir(ckpt / WEIGHTS_DIR):
        raise FileNotFoundError(f"checkpoint {ckpt} has no consolidated {WEIGHTS_DIR}/ folder")
    return ckpt / WEIGHTS_DIR, p


def check_against_run(config: ModelConfig, run_cfg: dict[str, Any], where: Path) -> None:
    """Raise ``CheckpointMismatchError`` when the weights' config differs from what the run's config.yaml builds
    (``attention.impl``, every layer's under a schedule, may differ: it changes no parameter)."""
    if "model" not in run_cfg or "attention" not in run_cfg:
        return
    attention = saved_attention(run_cfg["attention"])[0]
    expected = _without_impl(ModelSpec.from_dict(run_cfg["model"]).build(attention, config.vocab_size))
    actual = _without_impl(config)
    diff = [
        f"{k}: run {expected[k]!r} vs checkpoint {actual.get(k)!r}" for k in expected if expected[k] != actual.get(k)
    ]
    if diff:
        raise CheckpointMismatchError(
            f"the checkpoint {where} does not match its run's config.yaml: " + "; ".join(diff)
        )


def _without_impl(config: ModelConfig) -> dict[str, Any]:
    """``config.to_dict()`` without the ``impl`` of its attention and of each layer segment's."""
    d = config.to_dict()
    for attention in [d["attention"], *(seg["attention"] for seg in d.get("layers", []))]:
        attention.pop("impl", None)
    return d


def _run_lookup(
    run_cfg: dict[str, Any], tokenizer: Optional[Tokenizer], where: Path
) -> tuple[Optional[LookupConfig], Optional[LookupFormat]]:
    """The lookup settings and id layout a run trained on (``None`` for pure text runs), resolved by the data
    package's ``lookup_format_for`` with its checks."""
    data = run_cfg.get("data")
    if not isinstance(data, dict):
        return None, None
    dc = DataConfig.from_dict(data)
    try:
        fmt = lookup_format_for(dc, tokenizer)
    except ValueError as e:  # DataError too: the run's tokenizer does not hold its lookup layout
        raise CheckpointMismatchError(f"the lookup layout of {where}'s run cannot be resolved: {e}") from e
    return (dc.lookup, fmt) if fmt is not None else (None, None)


def _run_eval_words(run_cfg: dict[str, Any], tokenizer: Optional[Tokenizer]) -> Optional[dict[str, Any]]:
    """The words and pad a pretraining run (``data.kind: pretrain``) held out of its retrieval blocks for the lookup
    evaluation, and the id of its end-of-document token, which opens a prompt as it opens a document in training
    (``{"keys", "values", "pad", "bos"}``; ``bos`` None without the run's tokenizer), or ``None``."""
    data = run_cfg.get("data")
    if not isinstance(data, dict) or data.get("kind") != "pretrain":
        return None
    dc = DataConfig.from_dict(data)
    words = {"keys": list(dc.recall.eval_keys or []), "values": list(dc.recall.eval_values or [])}
    bos = tokenizer.token_to_id(dc.text.eod_token) if tokenizer is not None else None
    return {**words, "pad": dc.recall.eval_pad, "bos": bos}


def read_tokenizer(path: Path) -> Tokenizer:
    """The ``tokenizer.json`` of a weights folder; ``CheckpointError`` naming it and the way out when it is damaged
    (not JSON, or JSON that is no tokenizer) or not readable by this user."""
    read_json_file(path, WEIGHTS_FIX)
    try:
        return Tokenizer.from_str(read_text(path, WEIGHTS_FIX))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise damaged(path, f"not a tokenizer ({e})", WEIGHTS_FIX) from None


def _default_out_dir(weights: Path, run_dir: Optional[Path]) -> Path:
    if run_dir is not None and weights == run_dir / MODEL_DIR:
        return run_dir / EVAL_DIR
    if weights.name == WEIGHTS_DIR:  # checkpoints/step_X/weights -> checkpoints/step_X/eval
        return weights.parent / EVAL_DIR
    return weights / EVAL_DIR


def inspect_ckv_model(
    path: PathLike, step: Union[int, str, None] = None, impl: Optional[str] = None
) -> tuple[ModelFacts, Path]:
    """The ``ModelFacts`` of ckv weights in a run folder or weights folder (see ``find_weights``) and the weights
    folder, read from the configs and the tokenizer only (the weights are not loaded). ``impl`` overrides
    ``attention.impl``."""
    weights, run_dir = find_weights(path, step)
    config = load_config(weights)
    run_cfg = read_run_config(run_dir) if run_dir is not None else {}
    check_against_run(config, run_cfg, weights)
    tok_path = weights / TOKENIZER_FILE
    raw_tok = read_tokenizer(tok_path) if tok_path.is_file() else None
    lookup, fmt = _run_lookup(run_cfg, raw_tok, weights)
    stride = model_phase_stride(config)  # None: no phase (full attention)
    info = {
        "kind": "ckv",
        "path": str(Path(path).resolve()),
        "weights": str(weights.resolve()),
        "run_dir": str(run_dir.resolve()) if run_dir else None,
        "step": step,
        "run_name": run_cfg.get("name"),
        "seed": run_cfg.get("seed"),
        "config": config.to_dict(),
        "attention": config.describe_attention(),
    }
    trainer_state = weights.parent / STATE_FILE
    if trainer_state.is_file():
        info["trainer_state"] = read_json_file(trainer_state, "evaluate another checkpoint (model.step=...)")
        info["step"] = info["trainer_state"].get("step", step)  # a checkpoint's weights: the step they were saved at
    run_config = config.with_impl(impl) if impl else config  # the config it runs with: attention.impl as overridden
    facts = ModelFacts(
        name=run_cfg.get("name") or (run_dir.name if run_dir else weights.name),
        vocab_size=config.vocab_size,
        max_len=config.max_seq_len,
        stride=stride,
        tokenizer=TokenizersTokenizer(raw_tok) if raw_tok else None,
        lookup=lookup,
        lookup_format=fmt,
        eval_words=_run_eval_words(run_cfg, raw_tok),
        out_dir=_default_out_dir(weights, run_dir),
        info=info,
        kind="ckv",
        config=run_config,
    )
    return facts, weights


def load_ckv_model(
    path: PathLike, step: Union[int, str, None] = None, device: str = "auto", impl: Optional[str] = None
) -> LoadedModel:
    """Load ckv weights from a run folder or weights folder (see ``find_weights``), in eval mode.
    ``impl`` overrides ``attention.impl`` (e.g. ``reference`` for the oracle)."""
    facts, weights = inspect_ckv_model(path, step, impl)
    dev = resolve_device(device, "device")
    try:
        model = load_weights(weights, device=dev, impl=impl)
    except CheckpointError:  # a damaged or unreadable file, named with the way out
        raise
    except (ValueError, RuntimeError, SafetensorError) as e:
        raise CheckpointMismatchError(f"cannot load {weights}: {e}") from e
    model.eval()
    return LoadedModel(**facts_fields(facts), logits=CkvLastLogits(model), module=model, device=dev)


def facts_fields(facts: ModelFacts) -> dict[str, Any]:
    """The fields of ``facts`` as keyword arguments (to build a ``LoadedModel`` on them)."""
    return {f.name: getattr(facts, f.name) for f in fields(ModelFacts)}
