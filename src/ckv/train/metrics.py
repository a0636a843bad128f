"""What a run reports while it trains (rank 0 only): a progress bar, ``metrics.jsonl`` and Weights & Biases."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from ckv.io.atomic import write_text_atomic
from ckv.io.layout import METRICS_FILE
from ckv.train.config import WandbConfig

WANDB_ID_FILE = "wandb_id"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (training records have ``loss``, validation ones ``val_loss``)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Drop records after ``last_step`` (written by an invocation that was killed after its last checkpoint),
    so that a resumed run's file reads as one clean history."""
    path = Path(run_dir) / METRICS_FILE
    if path.is_file():
        kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= last_step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def wandb_mode(cfg: WandbConfig) -> str:
    """The mode wandb runs in: see ``WandbConfig``."""
    if not cfg.enabled:
        return "disabled"
    if cfg.mode != "auto":
        return cfg.mode
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


class MetricsLogger:
    """Rank 0 writes; on other ranks every method is a no-op. One record per ``log`` call goes to
    ``metrics.jsonl`` (flushed at once) and to wandb; ``progress`` moves the bar (loss, tokens/s, ETA)."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        wandb_cfg: WandbConfig,
        run_name: str,
        config: dict[str, Any],
        start_step: int,
        total_steps: int,
        show_progress: bool,
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._wandb = None
        self._bar: Optional[tqdm] = None
        self._show, self._start, self._total = show_progress, start_step, total_steps
        self._t0 = time.perf_counter()
        self._rate_t0, self._rate_step = self._t0, start_step  # where the ETA's step rate is measured from
        if not enabled:
            return
        self._file = open(self.run_dir / METRICS_FILE, "a")
        mode = wandb_mode(wandb_cfg)
        if mode != "disabled":
            self._wandb = self._start_wandb(wandb_cfg, mode, run_name, config)
        if show_progress and sys.stderr.isatty():
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    def _start_wandb(self, cfg: WandbConfig, mode: str, run_name: str, config: dict[str, Any]) -> Any:
        try:
            import wandb
        except ImportError:
            print(
                "ckv: wandb is not installed; metrics go to metrics.jsonl only "
                "(pip install wandb, or set wandb.enabled=false to silence this)",
                file=sys.stderr,
            )
            return None
        id_file = self.run_dir / WANDB_ID_FILE
        if not id_file.is_file():
            write_text_atomic(id_file, uuid.uuid4().hex[:12])
        return wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=run_name,
            id=id_file.read_text().strip(),
            resume="allow",
            dir=str(self.run_dir),
            config=config,
            mode=mode,
            tags=list(cfg.tags),
        )

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (must hold ``step``). ``None`` values are left out; a NaN or infinite value is
        written as ``null`` and its key listed under ``nonfinite``, so that every line is strict JSON."""
        if not self.enabled:
            return
        nonfinite = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        record = {
            **{k: (None if k in nonfinite else v) for k, v in record.items() if v is not None},
            **({"nonfinite": nonfinite} if nonfinite else {}),
            "time": round(time.time(), 3),
        }
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(
                {k: v for k, v in record.items() if k not in ("step", "time", "nonfinite") and v is not None},
                step=record["step"],
            )

    def start_clock(self, step: int) -> None:
        """Measure the ETA's step rate from ``step`` on: the steps before it (the first one compiles the model
        with ``trainer.compile``, and warms up) are left out of the estimate."""
        self._rate_t0, self._rate_step = time.perf_counter(), step

    def progress(self, step: int, **fields: Any) -> None:
        """Show progress at ``step`` with ``fields`` (e.g. loss, tokens/s): a live bar on a terminal, otherwise
        (SLURM logs, CI) one line per call with elapsed time and ETA."""
        if not (self.enabled and self._show):
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(fields, refresh=False)
            return
        now = time.perf_counter()
        elapsed = now - self._t0
        if step > self._rate_step:  # the rate since start_clock
            eta = (now - self._rate_t0) / (step - self._rate_step) * (self._total - step)
        else:
            eta = elapsed / max(step - self._start, 1) * (self._total - step)
        shown = " ".join(f"{k} {v}" for k, v in fields.items())
        print(
            f"step {step}/{self._total} ({100 * step / self._total:.0f}%) {shown} | elapsed {_clock(elapsed)} "
            f"eta {_clock(eta)}",
            file=sys.stderr,
            flush=True,
        )

    def message(self, text: str) -> None:
        """A line for the console (above the bar)."""
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(f"ckv: {text}", file=sys.stderr)

    def close(self, ok: bool = True) -> None:
        """Flush and close everything; ``ok=False`` marks the wandb run as failed."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=0 if ok else 1)
