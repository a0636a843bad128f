"""Audit mode: run ckv's tasks on any local transformers causal LM (a model ckv did not train).

Nothing is downloaded: the model folder must hold the config, the weights and (for word vocabularies and text
probes) the tokenizer. transformers is imported only here. Any causal LM loads (``AutoModelForCausalLM``, e.g.
Qwen3 or DeepSeek-V4); remote code runs only with ``trust_remote_code=True``. On CUDA with several devices and
accelerate installed, ``device_map="auto"`` spreads a large model over all of them; otherwise it sits on one device.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError

from ckv.config import ConfigError
from ckv.device import resolve_device
from ckv.eval.memory import ModelMemory, hf_model_memory
from ckv.eval.models import CheckpointMismatchError, LoadedModel, ModelFacts, facts_fields
from ckv.eval.scoring import check_chunk
from ckv.eval.vocab import HFTokenizer
from ckv.io.weights import check_finite

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFLastLogits:
    """Last-position logits of a transformers causal LM (``logits_to_keep=1``: the LM head runs once).

    ``chunk=None``: one forward without a cache. ``chunk=c``: chunked prefill, ``c`` tokens per forward through
    the model's own cache (``DynamicCache``, passed as ``cache`` or, for older model code, ``past_key_values``),
    so activation and attention memory are bounded by the chunk; equals the full forward (tested on Qwen3 and
    DeepSeek-V4)."""

    def __init__(self, model: Any, chunk: Optional[int] = None) -> None:
        if chunk is not None:
            check_chunk(chunk)
        self.model, self.chunk = model, chunk
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.chunk is None:
            return self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits[:, -1]  # (B, V)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for start in range(0, input_ids.shape[1], self.chunk):
            out = self.model(
                input_ids=input_ids[:, start : start + self.chunk],
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )  # the cache grows in place
        return out.logits[:, -1]  # (B, V)


def device_map_for(device: torch.device) -> Optional[str]:
    """``"auto"`` when the device is CUDA, more than one CUDA device exists and accelerate is installed
    (transformers then spreads the layers over every GPU); else ``None`` (the model sits on ``device``)."""
    several = device.type == "cuda" and torch.cuda.device_count() > 1
    return "auto" if several and importlib.util.find_spec("accelerate") is not None else None


def _max_len(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(f"cannot tell the context length of {type(config).__name__}: it has no max_position_embeddings")


def _tokenizer_dir(path: Path, tokenizer: Optional[Union[str, Path]]) -> Optional[Path]:
    """The folder whose tokenizer files to load: ``tokenizer`` (which must hold them) or the model folder if it
    has them; ``None`` when the model folder has none."""
    tok_dir = Path(tokenizer) if tokenizer is not None else path
    has_tok = any((tok_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if tokenizer is not None and not has_tok:
        raise FileNotFoundError(f"model.tokenizer={str(tok_dir)!r} holds no tokenizer files")
    return tok_dir if has_tok else None


def inspect_hf_model(
    path: Union[str, Path],
    dtype: str = "float32",
    tokenizer: Optional[Union[str, Path]] = None,
    stride: Optional[int] = None,
    trust_remote_code: bool = False,
) -> ModelFacts:
    """The ``ModelFacts`` of a local transformers causal LM from its ``config.json`` and tokenizer (the weights
    are not read). ``stride``: the model's compression stride when it has one (transformers configs do not say)."""
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is in the dev extra
        raise ImportError("audit mode needs transformers: pip install 'ckv[dev]' or pip install transformers") from e
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path={str(p)!r} is not a transformers model folder (no config.json)")
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} is not allowed; choose one of {list(DTYPES)}")
    cfg = AutoConfig.from_pretrained(str(p), local_files_only=True, trust_remote_code=trust_remote_code)
    tok_dir = _tokenizer_dir(p, tokenizer)
    tok = (
        AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True, trust_remote_code=trust_remote_code)
        if tok_dir is not None
        else None
    )
    info = {
        "kind": "hf",
        "path": str(p.resolve()),
        "architecture": (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0],
        "dtype": dtype,
        "device_map": None,
        "config": cfg.to_dict(),
        "attention": {
            "kind": "unknown" if stride is None else "compressed",
            "stride": stride,
            "window": None,
            "pooling": None,
        },
    }
    return ModelFacts(
        name=p.name,
        vocab_size=int(cfg.vocab_size),
        max_len=_max_len(cfg),
        stride=stride,
        tokenizer=HFTokenizer(tok) if tok is not None else None,
        out_dir=p / "eval",
        info=info,
        kind="hf",
        config=cfg,
        dtype=DTYPES[dtype],
        trust_remote_code=trust_remote_code,
    )


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
    (transformers configs do not say). On several GPUs the model is spread over all of them (``device_map_for``)."""
    from transformers import AutoModelForCausalLM

    facts = inspect_hf_model(path, dtype, tokenizer, stride, trust_remote_code)
    p = Path(path)
    dev = resolve_device(device, "device")
    device_map = device_map_for(dev)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(p), dtype=facts.dtype, local_files_only=True, trust_remote_code=trust_remote_code, device_map=device_map
        )
    except torch.cuda.OutOfMemoryError:  # a RuntimeError, but not a damaged file
        raise
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # a corrupt or missing weights file
        raise CheckpointMismatchError(f"cannot load the weights of {p}: {e}") from e
    if device_map is None:
        model = model.to(dev)
    else:  # inputs go to the device of the first layers (the embedding)
        dev = next(model.parameters()).device
    model.eval()
    check_finite(dict(model.named_parameters()), p)
    facts.config = model.config  # as loaded: it names the attention implementation transformers picked
    facts.info.update(
        architecture=type(model).__name__,
        device_map=getattr(model, "hf_device_map", None) if device_map else None,
        config=model.config.to_dict(),
    )
    return LoadedModel(**facts_fields(facts), logits=HFLastLogits(model), module=model, device=dev)


def hf_memory(model: ModelFacts, module: Optional[Any] = None) -> ModelMemory:
    """The needle's memory description of a transformers model (``ckv.eval.memory.hf_model_memory``): its
    parameters and attention implementation come from ``module`` when loaded, else from an empty copy built on
    the ``meta`` device (no memory, no weights read)."""
    if module is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            module = AutoModelForCausalLM.from_config(
                copy.deepcopy(model.config), trust_remote_code=model.trust_remote_code
            )
    n_params = sum(p.numel() for p in module.parameters())
    attn = getattr(module.config, "_attn_implementation", None) or "eager"
    return hf_model_memory(module.config, model.dtype, attn, n_params)
