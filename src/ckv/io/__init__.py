"""The shared I/O layer below training and evaluation: the run-folder contract (``layout``), atomic writes with the
umask's file modes (``atomic``), the output-folder check every entry point makes before any work (``access``), the
one-writer lock of a run folder (``lock``), result files (``results``), consolidated weights
(``weights``, refusing non-finite tensors) and the transformers converter (``hf``).

It imports only the model layer (config, model); data, train, eval and analysis build on it."""
