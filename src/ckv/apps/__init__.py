"""Applications on top of the library: ``python -m ckv.apps.demo`` (make demo), ``python -m ckv.apps.demo_v4``
(make demo-v4, with ``ckv.apps.train_hf_v4``: transformers' DeepSeek-V4 on ckv's data) and ``python -m
ckv.apps.smoke``."""
