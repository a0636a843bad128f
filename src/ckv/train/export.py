"""Export a checkpoint's consolidated weights on demand (``ckv.io.weights`` format + tokenizer.json):

    python -m ckv.train.export RUN_DIR [--checkpoint step_00001000] [--out DIR]

Training itself writes ``<run_dir>/model/`` at the end (``ckv.train.checkpoint.export_model``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Optional

from safetensors.torch import load_file

from ckv.io.atomic import fsync_tree, replace_dir
from ckv.io.layout import CHECKPOINTS_DIR, MODEL_DIR, WEIGHTS_DIR, CheckpointError, latest_checkpoint
from ckv.io.weights import WEIGHTS_FILE, NonFiniteWeightsError, check_finite, is_weights_dir


def export_checkpoint(run_dir: Path, checkpoint: Optional[str] = None, out: Optional[Path] = None) -> Path:
    """Copy a checkpoint's consolidated weights (default: the latest) to ``out`` (default ``<run_dir>/model``),
    refusing weights with NaN/inf values (``NonFiniteWeightsError``)."""
    run_dir = Path(run_dir)
    ckpt = run_dir / CHECKPOINTS_DIR / checkpoint if checkpoint else latest_checkpoint(run_dir)
    if ckpt is None or not is_weights_dir(ckpt / WEIGHTS_DIR):
        raise CheckpointError(f"no checkpoint weights to export in {run_dir} (checkpoint={checkpoint or 'latest'})")
    check_finite(load_file(str(ckpt / WEIGHTS_DIR / WEIGHTS_FILE)), ckpt / WEIGHTS_DIR / WEIGHTS_FILE)
    out = Path(out) if out is not None else run_dir / MODEL_DIR
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt / WEIGHTS_DIR, tmp)
    fsync_tree(tmp)
    replace_dir(tmp, out)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint", help="checkpoint folder name (default: the latest)")
    parser.add_argument("--out", type=Path, help="output folder (default: RUN_DIR/model)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.checkpoint, args.out)
    except (CheckpointError, NonFiniteWeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
