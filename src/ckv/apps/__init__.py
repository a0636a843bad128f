"""Applications on top of the library: ``python -m ckv.apps.demo`` (make demo) and ``python -m ckv.apps.smoke``."""
