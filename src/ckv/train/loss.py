"""Next-token cross-entropy fused with the output projection, chunked over tokens.

``chunked_cross_entropy(hidden, weight, labels)`` equals ``F.cross_entropy((hidden @ weight.T).float(), labels,
ignore_index=...)`` (mean over the labelled positions, 0 when there are none) without ever holding the logits of
the whole micro-batch: each chunk of ``chunk_tokens`` tokens computes its logits (in the input dtype, as the LM
head would, then fp32), its loss and, when a gradient is needed, its gradients with respect to the hidden states
and the head weight (the fp32 logits buffer becomes the logits' gradient in place), and drops it before the next
chunk. Backward then only scales the stored gradients (no logits are kept or recomputed). On CPU only the labelled
rows reach the head (a loss on a retrieval block's answers scores a few positions of each sequence); on an
accelerator every row does, as counting the labelled ones would be a host sync. Peak extra memory: one
chunk's fp32 logits (``chunk_tokens * vocab * 4`` bytes, plus the same in the compute dtype when that is not
fp32), the hidden-state gradient (the size of ``hidden``) and an fp32 accumulator for the weight gradient
(``vocab * d * 4`` bytes).
"""

from __future__ import annotations

from typing import Optional

import torch

DEFAULT_IGNORE_INDEX = -100  # the label of positions without a loss; equals ckv.data.IGNORE (tested)
DEFAULT_CHUNK_TOKENS = 4096


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ w.T`` against ``labels``; gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(
        ctx, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int, ignore_index: int, grads: bool
    ) -> torch.Tensor:  # h (N, D), w (V, D), labels (N,)
        need_h, need_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        keep = labels != ignore_index  # (N,)
        count = keep.sum().clamp(min=1).to(torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        for s in range(0, h.shape[0], chunk):
            hc, yc, kc = h[s : s + chunk], labels[s : s + chunk], keep[s : s + chunk]
            rows = torch.arange(hc.shape[0], device=h.device)
            logits = (hc @ w.T).float()  # (c, V): the only (c, V) buffer; turned into the gradient in place
            target = logits[rows, yc.clamp(min=0)]  # (c,)
            m = logits.amax(dim=-1)  # (c,)
            p = logits.sub_(m[:, None]).exp_()  # unnormalised softmax
            z = p.sum(dim=-1)  # (c,)
            total = total + torch.where(kc, m + z.log() - target, 0.0).sum()
            if need_h or need_w:
                p.mul_((kc.to(p.dtype) / (z * count))[:, None])  # softmax, / count, 0 on ignored rows
                p[rows, yc.clamp(min=0)] -= kc.to(p.dtype) / count  # d(mean loss)/d(logits)
                grad = p.to(h.dtype)
                if need_h:
                    dh[s : s + chunk] = grad @ w
                if need_w:
                    dw += (grad.T @ hc).float()
            del logits, p
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = w.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dh, dw = ctx.saved_tensors
        gh = None if dh is None else dh * grad_out.to(dh.dtype)
        gw = None if dw is None else (dw * grad_out).to(ctx.w_dtype)
        return gh, gw, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32 scalar) of the logits ``hidden @ weight.T`` over the labels that are
    not ``ignore_index``; hidden (..., D) (e.g. (B, T, D) final-norm states), weight (V, D) (the LM head), labels
    (...) matching hidden's leading dims. Never holds more than ``chunk_tokens`` tokens' logits."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., {hidden.shape[-1]}) does not match the head weight {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match hidden's leading dims {tuple(hidden.shape[:-1])}")
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (N, D), (N,)
    if h.device.type == "cpu":  # only the labelled rows reach the head (a loss on answers scores few of them);
        keep = y != ignore_index  # (N,) on an accelerator the mask's count would be a host sync: every row goes
        h, y = h[keep], y[keep]  # (n, D), (n,): the gather's backward scatters dh back, 0 on the ignored rows
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)  # forward runs with grad off
    return _FusedLinearCrossEntropy.apply(h, weight, y, chunk_tokens, ignore_index, grads)


def logits_bytes(tokens: int, vocab_size: int, chunk_tokens: Optional[int], compute_bytes: int = 2) -> int:
    """Bytes the loss holds for logits at its peak (an estimate for planning). ``chunk_tokens=None`` (today's
    path): the whole micro-batch's logits in the compute dtype, their fp32 copy and the fp32 log-softmax that
    autograd saves; chunked: one chunk's logits in the compute dtype and its fp32 buffer (the weight gradient's
    fp32 accumulator, ``vocab * d * 4`` bytes, is not included)."""
    extra = compute_bytes if compute_bytes != 4 else 0
    if chunk_tokens is None:
        return tokens * vocab_size * (extra + 4 + 4)
    return min(tokens, chunk_tokens) * vocab_size * (extra + 4)
