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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

import torch
import yaml
from safetensors import SafetensorError
from torch import nn

from ckv.attention import CompressedAttention
from ckv.cache import CompressedLayerCache
from ckv.config import ConfigError
from ckv.data import lookup_format_for
from ckv.data.config import DataConfig, LookupConfig
from ckv.data.lookup import LookupFormat
from ckv.device import resolve_device
from ckv.eval.memory import ModelMemory, hf_model_memory
from ckv.eval.models import CheckpointMismatchError, LoadedModel, ModelFacts, facts_fields
from ckv.eval.scoring import check_chunk
from ckv.eval.vocab import HFTokenizer
from ckv.geometry import compressed_mask, shifted_origin
from ckv.io.layout import CONFIG_FILE, CheckpointError, check_readable, read_json_file
from ckv.io.weights import check_finite

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HF_FIX = "restore the model folder from its source (copy or download it again)"  # for a damaged file in it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")  # read as JSON before transformers reads them


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
    has_tok = any((tok_dir / f).is_file() for f in TOKENIZER_FILES)
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
    tok_dir = _tokenizer_dir(p, tokenizer)
    for folder in (p, tok_dir) if tok_dir is not None else (p,):
        for name in JSON_FILES:
            if (folder / name).is_file():
                read_json_file(folder / name, HF_FIX)  # a damaged or unreadable file named, not a traceback
    try:
        cfg = AutoConfig.from_pretrained(str(p), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{p / 'config.json'} is not a transformers config ({type(e).__name__}: {e}); {HF_FIX}"
        ) from None
    try:
        tok = (
            AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True, trust_remote_code=trust_remote_code)
            if tok_dir is not None
            else None
        )
    except ImportError:  # a missing package (sentencepiece, tiktoken), named by transformers
        raise
    except Exception as e:  # tokenizers raises bare Exceptions, transformers KeyErrors, for a malformed file
        raise CheckpointError(f"the tokenizer in {tok_dir} does not load ({type(e).__name__}: {e}); {HF_FIX}") from None
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
        **dict(zip(("lookup", "lookup_format"), ckv_trained_layout(p))),
    )


def ckv_trained_layout(path: Path) -> tuple[Optional[LookupConfig], Optional[LookupFormat]]:
    """The lookup settings and id layout a transformers model trained by ckv on synthetic lookups was trained on:
    the ``data`` section of the ``config.yaml`` that ``ckv.apps.train_hf_v4`` writes beside the weights, read as a
    ckv run's is (``lookup_format_for``), so the lookup and the needle default to that layout; ``(None, None)`` for
    a folder without one (any other transformers model) or a model that trained on text."""
    record = path / CONFIG_FILE
    if not record.is_file():
        return None, None
    data = (yaml.safe_load(record.read_text()) or {}).get("data")
    if not isinstance(data, dict):
        return None, None
    cfg = DataConfig.from_dict(data)
    try:
        fmt = lookup_format_for(cfg) if cfg.kind == "lookup" else None
    except ValueError as e:
        raise ConfigError(f"the lookup layout in {record} cannot be resolved: {e}") from None
    return (cfg.lookup, fmt) if fmt is not None else (None, None)


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
    for weights in sorted(p.glob("*.safetensors")):
        check_readable(weights)  # safetensors reports a file this user may not read as "No such file or directory"
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


def hf_memory(
    model: ModelFacts, module: Optional[Any] = None, dual_offsets: Optional[dict[str, int]] = None
) -> ModelMemory:
    """The needle's memory description of a transformers model (``ckv.eval.memory.hf_model_memory``): its
    parameters and attention implementation come from ``module`` when loaded, else from an empty copy built on
    the ``meta`` device (no memory, no weights read); ``dual_offsets``: DeepSeek-V4's compressed layer types with
    dual-offset compression and their offsets (their moved entries join the cache)."""
    if module is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            module = AutoModelForCausalLM.from_config(
                copy.deepcopy(model.config), trust_remote_code=model.trust_remote_code
            )
    n_params = sum(p.numel() for name, p in module.named_parameters() if DeepseekV4Dual.COPY not in name)
    attn = getattr(module.config, "_attn_implementation", None) or "eager"
    return hf_model_memory(module.config, model.dtype, attn, n_params, dual_offsets=dual_offsets)


# ---- dual-offset compression on transformers' DeepSeek-V4 (ckv.eval.mitigation) ---------------------------------
def is_deepseek_v4(config: Any) -> bool:
    """Whether a transformers config is DeepSeek-V4's with at least one compressed (CSA or HCA) layer."""
    types = set(getattr(config, "layer_types", None) or ())
    compressed = {"compressed_sparse_attention", "heavily_compressed_attention"}
    return getattr(config, "model_type", None) == "deepseek_v4" and bool(types & compressed)


class DeepseekV4Dual(nn.Module):
    """transformers' DeepSeek-V4 compressor of one attention layer (``DeepseekV4CSACompressor`` or ``HCA``) with
    dual-offset compression: its own entries and block mask, then the entries of its windows moved by ``offset``,
    pooled by ckv's copy of the layer (``ckv.io.hf.attention_from_deepseek_v4``: the same weights, parity-tested
    with transformers' compressor) at the moved grid (``CompressedAttention.moved_entries``), RoPE'd at their own
    block starts, each visible to a query once its last token is (block mask 0, else -inf). V4's attention appends
    them to its keys and mask, so they enter its one eager softmax with the sliding window and the sink. In a
    chunked prefill (a cache) the moved grid keeps its own ckv cache; a forward that starts at position 0 starts a
    new sequence. ``enabled`` False (``off``) returns the compressor's output alone."""

    COPY = "ckv_copy"  # the ckv copy's submodule name (its parameters are not the model's: ``hf_memory``)

    def __init__(self, compressor: nn.Module, layer: CompressedAttention, offset: int) -> None:
        super().__init__()
        self.compressor = compressor
        self.ckv_copy = layer
        self.origin = shifted_origin(0, offset, layer.stride)
        self.state: Optional[CompressedLayerCache] = None
        self.enabled = True

    def forward(
        self, hidden_states: torch.Tensor, q_residual: torch.Tensor, position_ids: torch.Tensor, cache: Any,
        layer_idx: int,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
        kv, bias = self.compressor(hidden_states, q_residual, position_ids, cache, layer_idx)  # (B, 1, E, D)
        if not self.enabled:
            return kv, bias
        B, T, _ = hidden_states.shape
        start = int(position_ids[0, 0])
        if cache is not None and start == 0:
            self.state = CompressedLayerCache()
        elif cache is not None and (self.state is None or self.state.length != start):
            raise RuntimeError("dual-offset compression: the moved entries' cache does not continue this sequence")
        sub = None if cache is None else self.state
        x = hidden_states.to(self.ckv_copy.o_proj.weight.dtype)
        moved, _ = self.ckv_copy.moved_entries(x, start, self.origin, sub)  # (B, Ex, 1, D)
        moved = moved.transpose(1, 2).to(kv.dtype)  # (B, 1, Ex, D)
        q_pos = torch.arange(start, start + T, device=kv.device) + self.origin  # the queries in the moved grid
        visible = compressed_mask(q_pos, moved.shape[2], self.ckv_copy.stride)  # (T, Ex)
        moved_bias = kv.new_zeros(T, moved.shape[2]).masked_fill(~visible, float("-inf")).expand(B, 1, T, -1)
        if bias is None:  # V4 gives none when every entry is visible (a one-token step, or no entry yet)
            bias = kv.new_zeros(B, 1, T, kv.shape[2])
        return torch.cat([kv, moved], dim=2), torch.cat([bias, moved_bias], dim=-1)

    @staticmethod
    @contextmanager
    def off(module: nn.Module) -> Iterator[None]:
        """Within the block, every ``DeepseekV4Dual`` of ``module`` returns its compressor's output alone (the
        unmitigated model, e.g. to count its FLOPs)."""
        duals = [m for m in module.modules() if isinstance(m, DeepseekV4Dual)]
        for m in duals:
            m.enabled = False
        try:
            yield
        finally:
            for m in duals:
                m.enabled = True


def dual_offset_v4(module: nn.Module, offsets: dict[str, int]) -> int:
    """Give every compressed attention layer of transformers' DeepSeek-V4 ``module`` dual-offset compression in
    place (its compressor wrapped in a ``DeepseekV4Dual``; ``offsets``: the offset per layer type); returns the
    number of layers patched."""
    from ckv.io.hf import attention_from_deepseek_v4

    patched = 0
    for m in list(module.modules()):
        compressor = getattr(m, "compressor", None)
        if type(m).__name__ != "DeepseekV4Attention" or compressor is None or isinstance(compressor, DeepseekV4Dual):
            continue
        m.compressor = DeepseekV4Dual(compressor, attention_from_deepseek_v4(m).eval(), offsets[m.layer_type])
        patched += 1
    return patched
