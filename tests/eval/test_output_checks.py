"""eval.py refuses before any weights load: a results folder it can not write (a file, below a file, another user's
run), a damaged or unreadable file of the model folder (ckv and transformers), each one ``ckv: error:`` line with
exit code 2 naming the file, the cause and the way out (was a traceback of 49-58 lines after all the compute)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest

from ckv import ModelConfig, Transformer
from ckv.eval.runner import ModelSource
from ckv.io.hf import save_hf
from tests.helpers import as_other_user, assert_documented, eval_cli, run_script, world_readable_tmp

from .helpers import make_run

ROOT = Path(__file__).resolve().parents[2]
FAST = ["progress=false", "limit=2", "task.modulus=8", "device=cpu"]
GATE = dict(kind="compressed", window=4, stride=4, local_window=4)
WAY_OUT = "give a folder you can write to: out_dir=..."


@pytest.fixture
def never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any weights load fails the test: the refusals must come before it."""

    def load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(ModelSource, "load", load)


def _one_line(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    code, _, err = run_script("eval.py", args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ckv: error: "), err
    return lines[0]


def test_an_out_dir_that_is_a_file_is_refused_before_the_weights_load(
    tmp_path: Path, never_loaded: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = make_run(tmp_path, attention=GATE)
    file = tmp_path / "results.txt"
    file.write_text("mine")
    line = _one_line([f"model.path={run}", f"out_dir={file}", *FAST], monkeypatch, capsys)
    assert line == f"ckv: error: out_dir={str(file)!r} is a file, not a folder; {WAY_OUT}"
    assert_documented(line.replace(str(tmp_path), "/data"))
    below = file / "lookup"
    line = _one_line([f"model.path={run}", f"out_dir={below}", "analysis=gates", *FAST], monkeypatch, capsys)
    assert line == f"ckv: error: out_dir={str(below)!r} is below {str(file)!r}, a file, not a folder; {WAY_OUT}"
    line = _one_line([f"summary={tmp_path}", f"summary_out={file}", *FAST], monkeypatch, capsys)
    assert line == (
        f"ckv: error: the summary folder {str(file)!r} is a file, not a folder; give a folder you can write to: "
        "summary_out=..."
    )
    assert_documented(line.replace(str(tmp_path), "/data"))
    assert file.read_text() == "mine" and not (run / "eval").exists()


def _eval_py(*args: str) -> None:
    """``python eval.py <args>`` in this process (for ``as_other_user``'s child: its exit is the child's)."""
    os.chdir(ROOT)
    sys.argv = ["eval.py", *eval_cli().quote_path_values(list(args))]
    runpy.run_path(str(ROOT / "eval.py"), run_name="__main__")


def test_a_run_another_user_can_not_write_is_refused_before_the_weights_load(
    tmp_path: Path, never_loaded: None
) -> None:
    """A colleague's run (readable, not writable by this user): its default results folder is refused, naming the
    user and the folder, and the way out (out_dir=)."""
    run = make_run(tmp_path, attention=GATE)
    run.chmod(0o555)
    code, _, err = as_other_user(lambda: _eval_py(f"model.path={run}", *FAST))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(
        f"ckv: error: the results folder {str(run / 'eval' / 'lookup')!r} (the default out_dir) "
        "is not writable by user "
    )
    assert lines[0].endswith(f"(Permission denied: {str(run)!r}); {WAY_OUT}")
    if "by user nobody " in lines[0]:
        assert_documented(lines[0].replace(str(tmp_path), "/data"))


@pytest.mark.parametrize(
    "file, content, problem",
    [
        (
            "model/config.json",
            "{bad",
            "is damaged: not JSON (Expecting property name enclosed in double quotes: line 1 column 2)",
        ),
        (
            "model/tokenizer.json",
            "{bad",
            "is damaged: not JSON (Expecting property name enclosed in double quotes: line 1 column 2)",
        ),
        ("model/model.safetensors", None, "is damaged: SafetensorError: Error while deserializing header: "),
    ],
)
def test_a_damaged_file_of_a_ckv_model_is_one_line(
    tmp_path: Path,
    file: str,
    content: str | None,
    problem: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """Not JSON, truncated weights: one line naming the file, what is wrong and how to write it again."""
    run = make_run(tmp_path, attention=GATE)
    path = run / file
    if content is None:
        path.write_bytes(path.read_bytes()[:1000])
    else:
        path.write_text(content)
    line = _one_line([f"model.path={run}", *FAST], monkeypatch, capsys)
    assert line.startswith(f"ckv: error: {path} {problem}"), line
    assert line.endswith(
        "; write the folder again from an intact checkpoint (python -m ckv.train.export RUN_DIR [--checkpoint "
        "step_N] [--out FOLDER]) or restore it from a copy"
    )
    if content is not None:
        assert_documented(line.replace(str(tmp_path), "/data"))


def test_a_damaged_run_config_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = make_run(tmp_path, attention=GATE)
    (run / "config.yaml").write_text("model: [1, 2\nseed: 0\n")
    line = _one_line([f"model.path={run}", *FAST], monkeypatch, capsys)
    assert line == (
        f"ckv: error: {run / 'config.yaml'} is damaged: not YAML (expected ',' or ']', but got ':' at line 2 column "
        "5); restore it from a copy (train.py wrote it when the run started), or train into a new run folder (another "
        "name, seed or out_dir)"
    )
    assert_documented(line.replace(str(tmp_path), "/data"))


@pytest.mark.parametrize("file", ["model/model.safetensors", "model/config.json", "config.yaml"])
def test_a_file_this_user_may_not_read_is_named_with_permission(file: str) -> None:
    """A colleague's run whose file is private (mode 0600): the line names the permission, not "No such file or
    directory"."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test makes a file that another user (nobody) may not read")
    errors = eval_cli()
    with world_readable_tmp() as folder:
        run = make_run(folder, attention=GATE)
        (run / file).chmod(0o600)

        def load() -> None:
            with errors.user_errors():
                ModelSource(path=str(run)).load("cpu")

        code, _, err = as_other_user(load, read_anything=False)
        line = (
            f"ckv: error: {run / file} exists but user nobody may not read it (Permission denied); ask its owner "
            "for read access (chmod a+r), or work on a copy you can read"
        )
        assert (code, err.strip().splitlines()) == (2, [line])
        assert_documented(line.replace(str(folder), "/data"))


@pytest.mark.parametrize("file", ["config.json", "tokenizer.json"])
def test_a_damaged_file_of_a_transformers_model_is_one_line(
    tmp_path: Path, file: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    model = tmp_path / "hf"
    save_hf(Transformer(ModelConfig.from_preset("tiny", vocab_size=64)), model)
    (model / file).write_text("{bad")
    capsys.readouterr()  # save_pretrained's progress bar
    line = _one_line(["model=hf", f"model.path={model}", *FAST], monkeypatch, capsys)
    assert line == (
        f"ckv: error: {model / file} is damaged: not JSON (Expecting property name enclosed in double quotes: line 1 "
        "column 2); restore the model folder from its source (copy or download it again)"
    )
    assert_documented(line.replace(str(tmp_path), "/data"))
