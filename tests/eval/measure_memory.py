"""Child process of tests/eval/test_memory.py: the measured peak memory of chunked prefill on CPU.

Run as ``MALLOC_MMAP_THRESHOLD_=65536 python -m tests.eval.measure_memory <case> ...``; prints one JSON line per
case: the bytes the prefill added at its worst moment and the estimate (``ckv.eval.memory``) of the same run.
Method (benchmarks/memory.py's): glibc maps every allocation of 64 KiB or more on its own and unmaps it when freed,
so the resident set follows the live tensors; after a warm-up prefill (first-call costs), the kernel's high-water
mark is reset (``5`` to ``/proc/self/clear_refs``) and the prefill's peak is ``VmHWM`` minus the ``VmRSS`` before it:
KV cache, attention transients and activations (the weights are already resident, as in a real run).
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from ckv.eval.memory import ModelMemory, ckv_model_memory, estimate, hf_model_memory, needed

BATCH, CONTEXT, CHUNK = 2, 1024, 512


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _peak(prefill, ids: torch.Tensor) -> int:
    """Bytes ``prefill(ids)`` adds to the resident set at its worst moment."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    prefill(ids)
    return _status("VmHWM") - base


def qwen3(attn: str) -> tuple[object, ModelMemory]:
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=CONTEXT,
        attn_implementation=attn,
    )
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    n = sum(p.numel() for p in model.parameters())
    return model, hf_model_memory(model.config, torch.float32, model.config._attn_implementation, n)


def deepseek_v4(heads: int, index_heads: int) -> tuple[object, ModelMemory]:
    """Two CSA layers; ``heads`` query heads and ``index_heads`` indexer heads pick which transient dominates."""
    import transformers

    cfg = transformers.DeepseekV4Config(
        vocab_size=128,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        o_lora_rank=32,
        o_groups=2,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        sliding_window=8,
        index_topk=64,
        index_n_heads=index_heads,
        index_head_dim=32,
        hc_mult=1,
        layer_types=["compressed_sparse_attention"] * 2,
        mlp_layer_types=["moe", "moe"],
        max_position_embeddings=CONTEXT,
        partial_rotary_factor=8 / 32,
        num_nextn_predict_layers=0,
    )
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    n = sum(p.numel() for p in model.parameters())
    return model, hf_model_memory(model.config, torch.float32, "eager", n)


def ckv(kind: str) -> tuple[object, ModelMemory]:
    from ckv import ModelConfig, Transformer

    attention = {"kind": "full"} if kind == "full" else {"kind": "compressed", "window": 8, "stride": 4}
    cfg = ModelConfig(
        vocab_size=128,
        d_model=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        max_seq_len=CONTEXT,
        attention={**attention, "impl": "torch"},
    )
    return Transformer(cfg).eval(), ckv_model_memory(cfg, torch.device("cpu"))


CASES = {
    "qwen3_eager": lambda: qwen3("eager"),
    "qwen3_sdpa": lambda: qwen3("sdpa"),
    "deepseek_v4": lambda: deepseek_v4(16, 16),  # the attention scores dominate
    "deepseek_v4_indexer": lambda: deepseek_v4(2, 32),  # the indexer's scores dominate
    "ckv_compressed": lambda: ckv("compressed"),
    "ckv_full": lambda: ckv("full"),
}


def main(cases: list[str]) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from ckv.eval.hf_models import HFLastLogits
    from ckv.eval.scoring import CkvChunkedLastLogits
    from ckv.model import Transformer

    for case in cases:
        model, memory = CASES[case]()
        prefill = (CkvChunkedLastLogits if isinstance(model, Transformer) else HFLastLogits)(model, CHUNK)
        ids = torch.randint(0, 128, (BATCH, CONTEXT))
        with torch.inference_mode():
            prefill(ids[:, : 2 * CHUNK // 4])  # warm-up: lazily loaded code, thread pools
            measured = _peak(prefill, ids)
        est = estimate(memory, BATCH, CONTEXT, CHUNK)
        print(json.dumps({"case": case, "measured": measured, "estimated": needed(est, True), **est.to_dict()}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", choices=list(CASES), metavar="case", help=f"one or more of {list(CASES)}")
    main(parser.parse_args().cases)
