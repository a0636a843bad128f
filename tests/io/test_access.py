"""The output-folder check every entry point makes before any work (``ckv.io.access``), file modes that follow the
umask (``ckv.io.atomic.umask_mode``), and damaged or unreadable files named in one line (``ckv.io.layout``,
``ckv.io.weights``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ckv import ModelConfig, Transformer
from ckv.checks import ConfigError
from ckv.io.access import check_output_dir, remove_empty_folders
from ckv.io.atomic import atomic_path, umask, write_text_atomic
from ckv.io.layout import CheckpointError, check_readable, read_json_file, read_run_config
from ckv.io.lock import RunLock
from ckv.io.weights import WEIGHTS_FIX, is_weights_dir, load_config, read_state, save_weights
from tests.helpers import as_other_user, assert_umask_modes, world_readable_tmp

WAY_OUT = "give a folder you can write to: out_dir=..."


def _refusal(path: object, **kw: object) -> str:
    with pytest.raises(ConfigError) as e:
        check_output_dir(path, f"out_dir={str(path)!r}", WAY_OUT, **kw)
    return str(e.value)


def test_an_output_folder_is_checked_and_nothing_is_left_behind(tmp_path: Path) -> None:
    """A folder that can be made passes and is not made (a probe file in it, then both removed); a file, a path
    below a file, an empty path, a path under /proc and a folder of another kind are refused in one line naming the
    path, the cause and the way out."""
    nested = tmp_path / "a" / "b" / "c"
    assert check_output_dir(nested, "out_dir", WAY_OUT) == nested and list(tmp_path.iterdir()) == []
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", "out_dir", WAY_OUT)
    assert [p.name for p in tmp_path.iterdir()] == ["empty"] and list((tmp_path / "empty").iterdir()) == []
    file = tmp_path / "file"
    file.write_text("mine")
    assert _refusal(file) == f"out_dir={str(file)!r} is a file, not a folder; {WAY_OUT}"
    assert (
        _refusal(file / "runs")
        == f"out_dir={str(file / 'runs')!r} is below {str(file)!r}, a file, not a folder; {WAY_OUT}"
    )
    assert _refusal("") == f"out_dir='' is empty: it names no folder; {WAY_OUT}"
    assert _refusal("/proc/ckv_runs") == (
        f"out_dir='/proc/ckv_runs' can not be written (No such file or directory: '/proc/ckv_runs'); {WAY_OUT}"
    )
    weights = ("weights folder", is_weights_dir)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert _refusal(tmp_path / "notes", kind=weights) == (
        f"out_dir={str(tmp_path / 'notes')!r} holds other files (todo.txt) and is not a weights folder; {WAY_OUT}"
    )
    check_output_dir(tmp_path / "empty", "out_dir", WAY_OUT, kind=weights)  # empty: any kind may fill it
    assert file.read_text() == "mine" and (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_a_folder_another_user_can_not_write_is_refused(tmp_path: Path) -> None:
    """A folder whose owner alone may write (a colleague's, on a shared cluster folder): refused for another user,
    naming the user and the folder that denies it, and nothing is made."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)
    locked.chmod(0o555)  # even its owner may not write, unless root

    def check() -> None:
        try:
            check_output_dir(locked / "runs", f"out_dir={str(locked / 'runs')!r}", WAY_OUT)
        except ConfigError as e:
            sys.exit(str(e))

    code, _, err = as_other_user(check)
    assert code == 1 and err.startswith(f"out_dir={str(locked / 'runs')!r} is not writable by user "), err
    assert err.rstrip("\n").endswith(f"(Permission denied: {str(locked)!r}); {WAY_OUT}"), err
    assert list(locked.iterdir()) == []


def test_remove_empty_folders_stops_at_anything_kept(tmp_path: Path) -> None:
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "keep.txt").write_text("")
    remove_empty_folders(tmp_path / "a" / "b" / "c", tmp_path)
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["keep.txt"]
    remove_empty_folders(tmp_path / "a", tmp_path / "a")  # the stop folder itself is kept
    assert (tmp_path / "a").is_dir()


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_written_files_have_the_umask_mode(tmp_path: Path, mask: int) -> None:
    """Every writer's file gets the mode a plain open gives under the umask: safetensors' weights (which it writes
    0600), a writer that asks for 0600 itself, the atomic text writer, the run lock."""
    old = os.umask(mask)
    try:
        assert umask() == mask
        save_weights(Transformer(ModelConfig.from_preset("tiny", vocab_size=32)), tmp_path / "model")
        with atomic_path(tmp_path / "private.bin") as tmp:
            os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600))
        write_text_atomic(tmp_path / "notes" / "a.txt", "x")
        RunLock(tmp_path / "run").acquire().release()
    finally:
        os.umask(old)
    assert_umask_modes(tmp_path, mask)


def test_a_damaged_file_is_one_line_naming_it_and_the_way_out(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("name: x\ntrainer: [1, 2\nseed: 0\n")
    with pytest.raises(CheckpointError) as e:
        read_run_config(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'config.yaml'} is damaged: not YAML (expected ',' or ']', but got ':' at line 3 column 5); "
        "restore it from a copy (train.py wrote it when the run started), or train into a new run folder (another "
        "name, seed or out_dir)"
    )
    (tmp_path / "bad.json").write_text('{"a": 1,\n oops}')
    with pytest.raises(
        CheckpointError,
        match=r"bad.json is damaged: not JSON \(Expecting property name enclosed in "
        r"double quotes: line 2 column 2\); do this$",
    ):
        read_json_file(tmp_path / "bad.json", "do this")
    (tmp_path / "latin.json").write_bytes(b'{"a": "caf\xe9"}')
    with pytest.raises(CheckpointError, match=r"latin.json is damaged: not UTF-8 text \(byte 10\)$"):
        read_json_file(tmp_path / "latin.json")
    save_weights(Transformer(ModelConfig.from_preset("tiny", vocab_size=32)), tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as e:
        read_state(weights)
    assert str(e.value).startswith(f"{weights} is damaged: SafetensorError: ") and str(e.value).endswith(WEIGHTS_FIX)
    (tmp_path / "model" / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json is damaged: it holds a list, not a model config; write"):
        load_config(tmp_path / "model")


def test_a_file_this_user_may_not_read_is_named_with_permission_not_as_missing() -> None:
    """safetensors says "No such file or directory" for a file that exists but may not be read: the message names
    the permission, the user and the way out."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test makes a file that another user (nobody) may not read")
    with world_readable_tmp() as folder:
        save_weights(Transformer(ModelConfig.from_preset("tiny", vocab_size=32)), folder / "model")
        weights = folder / "model" / "model.safetensors"
        weights.chmod(0o600)

        def read() -> None:
            for step in (lambda: check_readable(weights), lambda: read_state(weights)):
                try:
                    step()
                except CheckpointError as e:
                    print(e)

        code, out, err = as_other_user(read, read_anything=False)
    assert code == 0, err
    line = (
        f"{weights} exists but user nobody may not read it (Permission denied); ask its owner for read access "
        "(chmod a+r), or work on a copy you can read"
    )
    assert out.splitlines() == [line, line]
