"""The shared I/O layer below training and evaluation: the run-folder contract (``layout``), atomic writes
(``atomic``), result files (``results``), consolidated weights (``weights``) and the transformers converter (``hf``).

It imports only the model layer (config, model); data, train, eval and analysis build on it."""
