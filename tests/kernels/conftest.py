"""Kernel tests run on CPU under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1). On a GPU
machine, ``TRITON_INTERPRET=0 pytest tests/kernels`` runs the same tests on CUDA; fp32 dots are then kept in
IEEE fp32 (not TF32) so the fp32 tolerances stay meaningful."""

import os

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
