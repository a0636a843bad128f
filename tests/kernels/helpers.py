"""Builders, tolerances and error measures shared by the kernel tests, and the whole-model comparison of one ``impl``
against the reference that the attention tests run too."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ckv_kernels
from ckv import ModelConfig, Transformer
from ckv.geometry import LocalWindow, compressed_mask, local_span, num_entries
from ckv.train.indexer import IndexerTraining, IndexerTrainingConfig, has_indexer
from tests.helpers import small_config

# CUDA when the kernels are compiled for it (TRITON_INTERPRET=0 on a GPU machine), else the interpreter on CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not ckv_kernels.INTERPRET else "cpu")
# Relative RMS error of a kernel against the reference allowed per input dtype; observed under the interpreter:
# fp32 ~5e-7, fp16 ~3e-4, bf16 ~4e-3. fp32 also bounds the max-abs error (relative to the largest reference value)
# at 10x this.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def local_args(local_window: LocalWindow, stride: int) -> dict:
    """The kernels' plain local-window arguments for a ckv ``local_window`` (as ``ckv.attention`` passes them)."""
    return {"local_span": local_span(local_window, stride), "tail": local_window == "tail"}


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS of the error over RMS of the reference (0 when both are 0)."""
    x, ref = x.double(), ref.double()
    err = (x - ref).pow(2).mean().sqrt().item()
    scale = ref.pow(2).mean().sqrt().item()
    return err / scale if scale > 0 else err


def rel_max(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error over the largest absolute reference value (0 when both are 0)."""
    x, ref = x.double(), ref.double()
    err = (x - ref).abs().max().item() if x.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return err / scale if scale > 0 else err


def attention_inputs(
    B: int,
    Tq: int,
    H: int,
    KV: int,
    D: int,
    *,
    stride: int,
    q_start: int = 0,
    extra_entries: int = 0,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Leaf tensors q (B, Tq, H, D), kc, vc (B, E, KV, D), k, v (B, q_start + Tq, KV, D): every exact key from
    position 0, and ``extra_entries`` entries beyond those the last query can see."""
    E = num_entries(q_start + Tq, stride) + extra_entries

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_()

    return [
        leaf(B, Tq, H, D),
        leaf(B, E, KV, D),
        leaf(B, E, KV, D),
        leaf(B, q_start + Tq, KV, D),
        leaf(B, q_start + Tq, KV, D),
    ]


def fp32_leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same values in fp32 as fresh leaves (the reference runs on them)."""
    return [t.detach().float().requires_grad_() for t in tensors]


def random_selection(
    B: int,
    Tq: int,
    E: int,
    K: int,
    *,
    stride: int,
    q_start: int = 0,
    exclude: tuple[int, ...] = (),
    list_invisible: bool = False,
) -> torch.Tensor:
    """(B, Tq, K) int64 top-k selection as an indexer makes it: per position, K distinct entries drawn at random
    among the visible ones (never those in ``exclude``), -1 in the slots left over, slots in random order. With
    ``list_invisible`` the left-over slots list entries the position does not see yet (they must count as empty)."""
    t = torch.arange(q_start, q_start + Tq, device=DEVICE)
    visible = compressed_mask(t, E, stride)[None].expand(B, Tq, E)  # (B, Tq, E)
    allowed = visible.clone()
    allowed[..., list(exclude)] = False
    scores = torch.rand(B, Tq, E, device=DEVICE) + 2 * allowed  # allowed first, then invisible, then excluded
    scores[..., list(exclude)] = -1.0
    top, idx = scores.topk(min(K, E), dim=-1)
    keep = (top >= 2) | ((top >= 0) & list_invisible & ~visible.gather(-1, idx))
    sel = torch.where(keep, idx, -1)
    sel = torch.cat([sel, sel.new_full((B, Tq, K - sel.shape[-1]), -1)], dim=-1)  # K > E: more empty slots
    return sel.gather(-1, torch.rand(B, Tq, K, device=DEVICE).argsort(-1))


def model_config(impl: str, **attention) -> ModelConfig:
    """A tiny 2-layer model with compressed attention at ``impl`` (W8/S8, 1 KV head, a 16-token local window);
    ``attention`` sets or overrides fields."""
    att = {**dict(kind="compressed", impl=impl, window=8, stride=8, kv_heads=1, local_window=16), **attention}
    return small_config(att, n_heads=4)


def loss_and_grads(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The LM loss, plus a lightning indexer's training loss where the model has one (its only gradient)."""
    indexer = IndexerTraining(model, IndexerTrainingConfig()) if has_indexer(model) else None
    if indexer is not None:
        indexer.start()
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    if indexer is not None:
        loss = loss + indexer.finish()[0]
        indexer.remove()
    names, params = zip(*model.named_parameters())
    return loss, dict(zip(names, torch.autograd.grad(loss, params)))


# fp32 model; the kernels and the reference differ by summation order only. Loss: relative difference < 1e-6;
# every parameter's gradient: relative RMS < 1e-4.
def assert_impls_match(attention: dict, seq_len: int, impl: str = "triton") -> None:
    """The same model with impl=reference and ``impl``: equal loss (1e-6 relative) and gradients (1e-4 rel. RMS)."""
    reference = Transformer(model_config("reference", **attention)).to(DEVICE)
    kernels = Transformer(model_config(impl, **attention)).to(DEVICE)
    kernels.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 64, (2, seq_len), device=DEVICE)
    loss_ref, grads_ref = loss_and_grads(reference, ids)
    loss_k, grads_k = loss_and_grads(kernels, ids)
    assert abs(loss_k.item() - loss_ref.item()) <= 1e-6 * abs(loss_ref.item())
    for name, g in grads_ref.items():
        assert rel_rms(grads_k[name], g) < 1e-4, name
