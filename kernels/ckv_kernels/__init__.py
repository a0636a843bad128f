"""ckv_kernels: Triton kernels of the compressed KV path (docs/kernels.md).

- ``pool``: the chunked compressor's pooling (learned scalar/vector gate or uniform mean), forward and backward;
- ``joint_attention``: one online softmax over visible compressed entries and the exact local window, with
  grouped-query attention, attention sinks and optional top-k selection, forward (with log-sum-exp) and backward.

Both match ``ckv.attention.reference`` and run on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (set before
this package is imported). Kernels and launchers live apart from each op's autograd Function and wrapper:
``pool_kernel`` / ``pool``; ``attention_fwd``, ``attention_bwd``, ``attention_select`` (sharing
``attention_common``) / ``attention``. Each module's ``__all__`` is its surface.
"""

from ckv_kernels._common import INTERPRET
from ckv_kernels.attention import joint_attention
from ckv_kernels.attention_common import SUPPORTED_HEAD_DIMS
from ckv_kernels.pool import pool

__all__ = ["INTERPRET", "SUPPORTED_HEAD_DIMS", "joint_attention", "pool"]
