"""Audit mode: run ckv's tasks on any local transformers causal LM (a model ckv did not train).

Nothing is downloaded: the model folder must hold the config, the weights and (for word vocabularies and text
probes) the tokenizer. transformers is imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch

from ckv.config import ConfigError
from ckv.device import resolve_device
from ckv.eval.models import LoadedModel
from ckv.io.weights import check_finite
from ckv.eval.vocab import HFTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFLastLogits:
    """Last-position logits of a transformers causal LM (``logits_to_keep=1``: the LM head runs once)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits[:, -1]  # (B, V)


def _max_len(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(f"cannot tell the context length of {type(config).__name__}: it has no max_position_embeddings")


def load_hf_model(
    path: Union[str, Path],
    device: str = "auto",
    dtype: str = "float32",
    tokenizer: Optional[Union[str, Path]] = None,
    stride: Optional[int] = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a local transformers causal LM (and its tokenizer, from ``tokenizer`` or the model folder if
    present), refusing weights with NaN/inf values. ``stride``: the model's compression stride when it has one
    (transformers configs do not say)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is in the dev extra
        raise ImportError("audit mode needs transformers: pip install 'ckv[dev]' or pip install transformers") from e
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path={str(p)!r} is not a transformers model folder (no config.json)")
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} is not allowed; choose one of {list(DTYPES)}")
    dev = resolve_device(device, "device")
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=DTYPES[dtype], local_files_only=True,
                                                 trust_remote_code=trust_remote_code).to(dev).eval()
    check_finite(dict(model.named_parameters()), p)
    tok_dir = Path(tokenizer) if tokenizer is not None else p
    has_tok = any((tok_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if tokenizer is not None and not has_tok:
        raise FileNotFoundError(f"model.tokenizer={str(tok_dir)!r} holds no tokenizer files")
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True,
                                        trust_remote_code=trust_remote_code) if has_tok else None
    cfg = model.config
    info = {"kind": "hf", "path": str(p.resolve()), "architecture": type(model).__name__, "dtype": dtype,
            "config": cfg.to_dict(), "attention": {"kind": "unknown" if stride is None else "compressed",
                                                   "stride": stride, "window": None, "pooling": None}}
    return LoadedModel(
        name=p.name, logits=HFLastLogits(model), module=model, device=dev, vocab_size=int(cfg.vocab_size),
        max_len=_max_len(cfg), stride=stride, tokenizer=HFTokenizer(tok) if tok is not None else None,
        out_dir=p / "eval", info=info,
    )
