"""Applications on top of the library: the studies over one runner (``ckv.apps.study``, ``conf/study/``):
``python -m ckv.apps.demo`` (make demo), ``python -m ckv.apps.demo_v4`` (make demo-v4, with
``ckv.apps.train_hf_v4``: transformers' DeepSeek-V4 on ckv's data), ``python -m ckv.apps.robust`` and ``python -m
ckv.apps.selection``; and ``python -m ckv.apps.smoke``."""
