"""``python -m ckv.train.export``: every bad input is one ``ckv: error:`` line with exit code 2 before anything is
written (was ``error: ...`` without the checkpoints that exist, and an ``--out`` file replaced by the weights
folder); the exported files get the umask's modes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ckv import ModelConfig, Transformer
from ckv.io.weights import WEIGHTS_FILE, load_weights, save_weights
from ckv.train.export import main
from tests.helpers import as_other_user, assert_documented, assert_umask_modes, tree_state

TINY = ModelConfig.from_preset("tiny", vocab_size=32)


def _run(folder: Path, steps: tuple[int, ...] = (1, 2)) -> Path:
    """A run folder as training leaves it, reduced to what export reads: checkpoints with weights."""
    for step in steps:
        ckpt = folder / "checkpoints" / f"step_{step:08d}"
        save_weights(Transformer(TINY), ckpt / "weights")
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "tokens": 0, "world_size": 1}))
    return folder


def _line(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


def test_bad_inputs_are_one_line_naming_the_checkpoints_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    _run(tmp_path / "run")
    (tmp_path / "weights.txt").write_text("mine")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    before = tree_state(tmp_path)
    its = "its checkpoints: step_00000001, step_00000002"
    cases = {
        ("nothing",): "ckv: error: RUN_DIR 'nothing' is not a folder; give a run folder of train.py",
        ("notes",): "ckv: error: nothing to export in notes: it has no complete checkpoint (is it a run folder?)",
        ("run", "--checkpoint", "step_9"): f"ckv: error: --checkpoint 'step_9' is not a checkpoint of run: {its}",
        ("run", "--out", "weights.txt"): "ckv: error: --out 'weights.txt' is a file, not a folder; give a new folder, "
        "or a weights folder to replace: --out DIR",  # was replaced by the weights folder, the file lost
        ("run", "--out", "notes"): "ckv: error: --out 'notes' holds other files (todo.txt) and is not a weights "
        "folder; give a new folder, or a weights folder to replace: --out DIR",
    }
    for argv, line in cases.items():
        assert _line(list(argv), capsys) == line, argv
        assert_documented(line)
    weights = tmp_path / "run" / "checkpoints" / "step_00000002" / "weights" / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:1000])
    line = _line(["run"], capsys)
    assert line.startswith(f"ckv: error: {weights.relative_to(tmp_path)} is damaged: SafetensorError: ")
    assert line.endswith("; export another checkpoint (--checkpoint; step_00000001, step_00000002)")
    del before["run/checkpoints/step_00000002/weights/model.safetensors"]
    after = tree_state(tmp_path)
    del after["run/checkpoints/step_00000002/weights/model.safetensors"]
    assert after == before


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_an_export_has_the_umask_modes_and_replaces_only_a_weights_folder(tmp_path: Path, mask: int) -> None:
    run = _run(tmp_path / "run")
    (run / "checkpoints" / "step_00000002" / "weights" / WEIGHTS_FILE).chmod(0o600)  # as an older ckv wrote it
    old = os.umask(mask)
    try:
        assert main([str(run), "--checkpoint", "step_00000002"]) == 0
        assert main([str(run), "--checkpoint", "step_00000001"]) == 0  # model/ replaced: a weights folder
    finally:
        os.umask(old)
    assert_umask_modes(run / "model", mask)
    assert load_weights(run / "model") is not None


def test_an_out_another_user_can_not_write_is_one_line(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    locked = tmp_path / "shared"
    locked.mkdir()
    locked.chmod(0o555)
    code, _, err = as_other_user(lambda: sys.exit(main([str(run), "--out", str(locked / "model")])))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"ckv: error: --out {str(locked / 'model')!r} is not writable by user ")
    assert list(locked.iterdir()) == [] and not (run / "model").exists()
    if "by user nobody " in lines[0]:
        assert_documented(lines[0].replace(str(tmp_path), "/data"))
