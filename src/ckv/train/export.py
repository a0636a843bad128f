"""Export a checkpoint's consolidated weights on demand (``ckv.io.weights`` format + tokenizer.json):

    python -m ckv.train.export RUN_DIR [--checkpoint step_00001000] [--out DIR]

Training itself writes ``<run_dir>/model/`` at the end (``ckv.train.checkpoint.export_model``). A bad input (no such
run or checkpoint, damaged weights, an ``--out`` that can not take a weights folder) is one ``ckv: error:`` line,
exit code 2, before anything is written; ``--out`` is replaced only when it is a weights folder (or empty).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Optional

from ckv.checks import ConfigError, error_message
from ckv.io.access import check_output_dir
from ckv.io.atomic import fsync_tree, replace_dir
from ckv.io.layout import CHECKPOINTS_DIR, MODEL_DIR, WEIGHTS_DIR, CheckpointError, latest_checkpoint, list_checkpoints
from ckv.io.weights import NonFiniteWeightsError, is_weights_dir, verify_weights

EXIT_USER_ERROR = 2


def _checkpoint(run_dir: Path, checkpoint: Optional[str]) -> Path:
    """The checkpoint folder to export: ``checkpoint`` (a folder name under ``checkpoints/``) or the latest;
    ``CheckpointError`` naming the run and the checkpoints it has otherwise."""
    if not run_dir.is_dir():
        raise CheckpointError(f"RUN_DIR {str(run_dir)!r} is not a folder; give a run folder of train.py")
    found = [p.name for _, p in list_checkpoints(run_dir)]
    have = f"its checkpoints: {', '.join(found)}" if found else "it has no complete checkpoint (is it a run folder?)"
    ckpt = run_dir / CHECKPOINTS_DIR / checkpoint if checkpoint else latest_checkpoint(run_dir)
    if ckpt is None or ckpt.name not in found:
        wanted = f"--checkpoint {checkpoint!r} is not a checkpoint of" if checkpoint else "nothing to export in"
        raise CheckpointError(f"{wanted} {run_dir}: {have}")
    if not is_weights_dir(ckpt / WEIGHTS_DIR):
        raise CheckpointError(f"{ckpt} has no consolidated {WEIGHTS_DIR}/ folder to export; {have}")
    return ckpt


def export_checkpoint(run_dir: Path, checkpoint: Optional[str] = None, out: Optional[Path] = None) -> Path:
    """Copy a checkpoint's consolidated weights (default: the latest) to ``out`` (default ``<run_dir>/model``).
    Everything is checked before anything is written: the checkpoint exists (``CheckpointError`` listing the run's
    checkpoints), its weights read in full and are finite (``verify_weights``), and ``out`` can take a weights
    folder (``ConfigError``: a file, not writable, or a folder holding other files)."""
    run_dir = Path(run_dir)
    ckpt = _checkpoint(run_dir, checkpoint)
    out = Path(out) if out is not None else run_dir / MODEL_DIR
    check_output_dir(
        out,
        f"--out {str(out)!r}",
        "give a new folder, or a weights folder to replace: --out DIR",
        kind=("weights folder", is_weights_dir),
    )
    verify_weights(
        ckpt / WEIGHTS_DIR,
        f"export another checkpoint (--checkpoint; {', '.join(p.name for _, p in list_checkpoints(run_dir))})",
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt / WEIGHTS_DIR, tmp, copy_function=shutil.copyfile)  # the umask's modes, not the source's
    fsync_tree(tmp)
    replace_dir(tmp, out)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ckv.train.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder of train.py")
    parser.add_argument("--checkpoint", help="checkpoint folder name, e.g. step_00001000 (default: the latest)")
    parser.add_argument(
        "--out", type=Path, help="output folder: new, empty or a weights folder (default: RUN_DIR/model)"
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.checkpoint, args.out)
    except (CheckpointError, NonFiniteWeightsError, ConfigError) as e:
        print(error_message(str(e)), file=sys.stderr)
        return EXIT_USER_ERROR
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
