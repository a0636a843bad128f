"""The Hydra entry point: every experiment composes into a valid TrainConfig, sweeps and the SLURM launcher are
well-formed, job folders are named by overrides and seed, and train.py runs end to end (smoke, multirun)."""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import subprocess
import sys

import pytest
import torch
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ckv.checks import error_message
from ckv.config import ConfigError, ModelSpec
from ckv.model import Transformer
from ckv.train import TrainConfig, read_metrics
from ckv.train.config import RESUMABLE_CHANGES, TrainerConfig, trajectory_neutral
from ckv.train.indexer import IndexerTrainingConfig
from tests.helpers import as_other_user, assert_documented, run_script

from .golden_attention import GOLDEN, composed_options
from .helpers import REPO, USER_DATA, child_env, compose_config, sweep, train_config

ENTRY = runpy.run_path(str(REPO / "train.py"), run_name="ckv_train_entry")  # registers the ckv_job_dir resolver
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def test_default_config_composes():  # plain `python train.py`
    cfg = train_config([])
    assert (cfg.name, cfg.model.preset, cfg.data.kind, cfg.deepspeed["zero_optimization"]["stage"]) == (
        "default",
        "tiny",
        "text",
        0,
    )


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def test_default_options_state_the_dataclass_defaults():
    """One source of defaults: what `python train.py` composes (each group's default option) states exactly the
    TrainConfig field defaults; optim, trainer and wandb state every field (so any field can be overridden)."""
    composed = OmegaConf.to_container(compose_config([]), resolve=True)
    defaults = TrainConfig(run_dir="unused").to_dict()
    # TrainConfig records the indexer's stages resolved for its model (0 without an indexer); the field defaults,
    # which the YAML states, are the recipe's (None)
    defaults["trainer"]["indexer"] = dataclasses.asdict(IndexerTrainingConfig())
    for section in ("name", "seed", "attention", "data", "optim", "trainer", "deepspeed", "wandb"):
        stated, default = _leaves({section: composed[section]}), _leaves({section: defaults[section]})
        assert {k: v for k, v in stated.items()} == {k: default[k] for k in stated}, section
        if section in ("optim", "trainer", "wandb", "deepspeed"):
            assert stated.keys() == default.keys(), section
    assert set(composed) - set(defaults) == {"out_dir"}  # the entry point's own key (not a TrainConfig field)
    # model: the preset and vocab of ModelSpec(), and every stated override is the preset's own value
    attention = defaults["attention"]
    assert ModelSpec.from_dict(composed["model"]).build(attention, 100) == ModelSpec().build(attention, 100)
    assert composed["model"]["preset"] == ModelSpec().preset


GROUP_BASES = {"attention": "full", "optim": "adamw_cosine", "trainer": "default"}
# the option that lists a group's nested option groups: the base, or (attention) the compressed base, since only
# compressed attention takes the option groups beyond rope
NESTED_BASES = {**GROUP_BASES, "attention": "w8s8"}


@pytest.mark.parametrize("group", sorted(GROUP_BASES))
def test_group_options_state_only_their_difference(group):
    """Every option of these groups starts (Hydra defaults) from the group's default option or another option of
    the group, and states only the fields whose value it changes."""
    base = GROUP_BASES[group]
    # config.yaml's default option
    assert compose_config([]).get(group) == compose_config([f"{group}={base}"]).get(group)
    for path in sorted((REPO / "conf" / group).glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        defaults = raw.pop("defaults", [])
        # nested option groups (attention/mixing, trainer/gate_entropy, ...) are listed by NESTED_BASES only
        nested = [d for d in defaults if isinstance(d, dict)]
        assert all((REPO / "conf" / group / next(iter(d))).is_dir() for d in nested), path.name
        assert not nested or path.stem == NESTED_BASES[group], path.name
        if path.stem == base:
            continue
        defaults = [d for d in defaults if not isinstance(d, dict)]
        parents = [d for d in defaults if d != "_self_"]
        assert len(parents) == 1 and (REPO / "conf" / group / f"{parents[0]}.yaml").is_file(), path.name
        inherited = _leaves(OmegaConf.to_container(compose_config([f"{group}={parents[0]}"])[group]))
        same = {k: v for k, v in _leaves(raw).items() if k in inherited and inherited[k] == v}
        assert raw and not same, f"{path.name} restates {same}"


def test_every_attention_option_composes_as_the_golden_file():
    """Each option (each YAML, and each group option on the group bases) composes to the values recorded in
    tests/train/golden/attention_options.json; after an intended change, regenerate it with
    ``python -m tests.train.golden_attention`` and review the diff."""
    golden = json.loads(GOLDEN.read_text())
    composed = composed_options()
    assert sorted(composed) == sorted(golden), "options added or removed: regenerate the golden file"
    for name, values in composed.items():
        assert values == golden[name], name


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    paper = experiment.startswith("paper") and experiment != "paper_cpu"  # the paper's scale: the user's shards
    cfg = train_config([f"experiment={experiment}"] + (USER_DATA if paper else []))
    robust = experiment.startswith("paper_robust")
    assert cfg.name == ("paper_robust" if robust else "paper" if paper else experiment)


def test_demo_models_differ_only_in_attention():
    """make demo's fairness: the control and the S = 2 model are the S = 4 gate model with one attention change."""
    gate4, gate2, full = (train_config([f"experiment={e}"]) for e in ("demo_gate_s4", "demo_gate_s2", "demo_full"))
    for other in (gate2, full):
        assert (other.model, other.data, other.optim, other.trainer) == (
            gate4.model,
            gate4.data,
            gate4.optim,
            gate4.trainer,
        )
    g4, g2, f = (c.model.build(c.attention, data_vocab_size=164) for c in (gate4, gate2, full))
    assert (g4.kv_heads, g4.d_model, g4.init_std) == (1, 128, 0.05)
    for m, geometry in ((g4, ("compressed", 4, 4, 4, "scalar")), (g2, ("compressed", 2, 2, 4, "scalar"))):
        a = m.attention
        assert (a.kind, a.window, a.stride, a.local_window, a.gate.kind) == geometry
    assert (f.attention.kind, f.kv_heads) == ("full", 1)


def test_paper_setup():
    cfg = train_config(["experiment=paper_base"] + USER_DATA)
    model = cfg.model.build(cfg.attention, data_vocab_size=151_669)
    assert (model.n_layers, model.d_model, model.n_heads, model.head_dim) == (28, 1024, 16, 128)
    a = model.attention
    assert (a.kind, a.window, a.stride, a.kv_heads, a.gate.kind, a.kv, a.rope.mode, a.local_window) == (
        "compressed",
        8,
        8,
        1,
        "scalar",
        "separate",
        "full",
        16,
    )
    tokens = cfg.trainer.max_steps * cfg.trainer.global_batch_size * cfg.data.seq_len
    assert cfg.trainer.max_steps == 47_518 and 99e9 < tokens < 101e9
    assert cfg.trainer.precision == "bf16" and cfg.seed == 42


def test_paper_grid():
    attention = {p.stem for p in (REPO / "conf" / "attention").glob("*.yaml")}
    assert sweep("paper_seeds") == {"seed": ["42", "43", "44", "45"]}
    variants = sweep("paper_variants")["attention"]
    full = sweep("paper_full")["attention"]
    assert len(variants) == 19 and len(set(variants)) == 19  # with the 4 seeds of W8/S8: 23 compressed runs
    assert set(variants) | set(full) <= attention and full == ["full_kv1", "full_kv4", "full_kv8"]
    for name in variants:
        cfg = train_config(["experiment=paper_base", f"attention={name}"] + USER_DATA)
        assert cfg.attention["kind"] == "compressed"
    assert sweep("cpu_grid") == {"attention": ["full", "w4s4", "w8s8"], "seed": ["0", "1"]}


def test_slurm_launcher_config(monkeypatch, tmp_path):
    """hydra/launcher=slurm builds a submitit SLURM executor whose sbatch script asks for the GPUs, tasks and the
    pre-timeout signal; nothing is submitted (map_array is intercepted)."""
    import submitit

    cfg = compose_config(
        ["experiment=paper_seeds", "hydra/launcher=slurm", f"out_dir={tmp_path}"] + USER_DATA, hydra_node=True
    )
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    captured = {}
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # pretend srun exists
    monkeypatch.setattr(
        submitit.AutoExecutor, "map_array", lambda self, fn, *args: captured.update(ex=self, args=args) or []
    )
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    launcher.launch([["seed=42"], ["seed=43"]], initial_job_idx=0)
    sbatch = captured["ex"]._executor._make_submission_file_text("srun python train.py", "uid")
    for line in ("--gpus-per-node=8", "--ntasks-per-node=8", "--signal=USR2@300", "--cpus-per-task=12"):
        assert line in sbatch, sbatch
    assert len(captured["args"][0]) == 2


def test_job_dir_name():
    name = ENTRY["job_dir_name"]
    assert name([], 3) == "seed=3"
    assert name(["attention.window=8", "attention.stride=4"], 0) == "attention.stride=4,attention.window=8,seed=0"
    assert "/" not in name(["data.text.paths=[/a/b]"], 1)
    long = name(["x=" + "a" * 300], 0)
    assert len(long) == ENTRY["MAX_DIR_NAME"] and long != name(["x=" + "a" * 299 + "b"], 0)


NEUTRAL_VALUES = {
    "name": "other",
    "run_dir": "/elsewhere",
    "trainer.progress": "false",
    "trainer.data_cache_dir": "/tmp/cache",
}


def _override(key: str) -> str:
    value = NEUTRAL_VALUES.get(key, "3")
    return f"{'+' if key == 'run_dir' else ''}{key}={value}"


def test_run_folder_name_leaves_out_exactly_the_resumable_keys():
    """The folder name and resume_conflicts share RESUMABLE_CHANGES: every key in it (and the keys that place the
    folder: experiment, out_dir, seed) is left out of the name; every other trainer field stays in it."""
    neutral = [_override(k if not k.endswith(".") else k + "mode") for k in RESUMABLE_CHANGES]
    neutral = [o.replace("wandb.mode=3", "wandb.mode=offline") for o in neutral]
    kept = [
        f"trainer.{f.name}={4 if f.name != 'device' else 'cpu'}"
        for f in dataclasses.fields(TrainerConfig)
        if not trajectory_neutral(f"trainer.{f.name}")
        and f.name != "precision"
        and f.default_factory is dataclasses.MISSING  # nested sections (trainer.gate_entropy) have their own keys
    ]
    assert len(kept) >= 4 and "trainer.max_steps=4" in kept
    placement = ["experiment=cpu_smoke", "out_dir=/runs", "seed=3"]
    cfg = compose_config(neutral + kept + placement + ["attention=w8s8"], hydra_node=True)
    expected = ",".join(sorted(kept + ["attention=w8s8"])) + ",seed=3"
    assert cfg.hydra.run.dir == f"/runs/other/{expected}"
    assert (cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir) == ("/runs/other", expected)


@pytest.mark.parametrize(
    "typo, field",
    [
        ("+model.n_layr=2", "unknown model field(s) ['n_layr']"),
        ("+attention.windw=8", "attention.windw is not a field of attention.kind='full'"),
        ("optim.lr=abc", "optim.lr='abc' must be a finite number > 0"),
        ("optim.lr=inf", "optim.lr=inf must be a finite number > 0"),
    ],
)
def test_bad_override_fails_before_any_data_is_prepared(tmp_path, typo, field, monkeypatch, capsys):
    """The default data (the shipped corpus) would train a BPE tokenizer first; a bad model, attention or optim
    value must fail before that, in one line, and leave the tokenizer cache untouched."""
    cache = tmp_path / "cache"
    args = [typo, f"out_dir={tmp_path}", f"trainer.data_cache_dir={cache}", "wandb.enabled=false"]
    code, _, err = run_script("train.py", args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"ckv: error: {field}"), err
    assert not cache.exists()
    assert list(tmp_path.iterdir()) == []  # the run folder Hydra made for the refused run is gone


@pytest.mark.parametrize(
    "overrides, line",
    [
        (  # the compressed option's one KV head would silently win over the model's 4 (issue 44)
            ["experiment=cpu_smoke", "+model.n_kv_heads=4"],
            "ckv: error: model.n_kv_heads=4 conflicts with attention.kv_heads=1 (set by attention=w4s4), which "
            "decides the KV head count when set: use attention.kv_heads=4 instead (it must divide model.n_heads)",
        ),
        (
            ["experiment=cpu_smoke", "+model.n_kv_heads=3"],
            "ckv: error: model.n_kv_heads=3 conflicts with attention.kv_heads=1",
        ),
        (
            ["experiment=cpu_smoke", "attention.kv_heads=3"],
            "ckv: error: model.n_heads=4 is not divisible by attention.kv_heads=3; grouped-query attention",
        ),
        (["+model.n_kv_heads=3"], "ckv: error: model.n_heads=4 is not divisible by model.n_kv_heads=3;"),
    ],
)
def test_kv_heads_have_one_source(tmp_path, overrides, line, monkeypatch, capsys):
    """The KV head count is attention.kv_heads when the attention option sets it, else model.n_kv_heads: a
    command-line model.n_kv_heads the attention overrides, or a count that does not divide the query heads, is one
    line naming the keys, before any data is prepared and without a run folder."""
    cache = tmp_path / "cache"
    args = [*overrides, f"out_dir={tmp_path}", f"trainer.data_cache_dir={cache}", "wandb.enabled=false"]
    code, _, err = run_script("train.py", args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(line), err
    assert list(tmp_path.iterdir()) == []
    assert_documented(lines[0])


@pytest.mark.parametrize(
    "out_dir, problem",
    [
        ("<tmp>/runs.txt", "is a file, not a folder"),
        ("<tmp>/runs.txt/cpu", "is below '<tmp>/runs.txt', a file, not a folder"),
        ("/proc/ckv_runs", "can not be written (No such file or directory: '/proc/ckv_runs')"),
        ("''", "is empty: it names no folder"),  # was "Permission denied"
    ],
)
def test_unusable_out_dir_is_one_line(tmp_path, out_dir, problem, monkeypatch, capsys):
    """An out_dir that can not be a folder this user writes to (a file, below a file, under /proc, empty): one line
    naming it, before Hydra makes the run folder (was a traceback of 27-54 lines), and nothing is made."""
    (tmp_path / "runs.txt").write_text("mine")
    out_dir = out_dir.replace("<tmp>", str(tmp_path))
    code, _, err = run_script("train.py", ["experiment=cpu_smoke", f"out_dir={out_dir}"], monkeypatch, capsys)
    lines = err.strip().splitlines()
    shown = "" if out_dir == "''" else out_dir
    problem = problem.replace("<tmp>", str(tmp_path))
    line = f"ckv: error: out_dir={shown!r} {problem}; give a folder you can write to: out_dir=..."
    assert code == 1 and lines == [line], err
    assert [p.name for p in tmp_path.iterdir()] == ["runs.txt"] and (tmp_path / "runs.txt").read_text() == "mine"
    assert_documented(line.replace(str(tmp_path), "/data"))


def test_a_run_refused_after_it_took_its_lock_leaves_no_folder(tmp_path, monkeypatch, capsys):
    """A fresh run refused inside training (here: the model's context is shorter than the data's sequences) left
    its run folder holding train.lock: the folder is removed like any refused run's."""
    args = ["experiment=cpu_smoke", "data=lookup_split", "data.seq_len=66", "model.max_seq_len=32"]
    code, _, err = run_script("train.py", [*args, f"out_dir={tmp_path}", "wandb.enabled=false"], monkeypatch, capsys)
    assert code == 1 and err.strip().splitlines()[-1] == (
        "ckv: error: data.seq_len=66 exceeds the model's max_seq_len=32; raise model.max_seq_len or lower data.seq_len"
    ), err
    assert list(tmp_path.iterdir()) == []


def _train_py(*args: str) -> None:
    """``python train.py <args>`` in this process (for ``as_other_user``'s child: its exit is the child's)."""
    os.chdir(REPO)
    sys.argv = ["train.py", *args]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


def test_out_dir_another_user_can_not_write_is_one_line(tmp_path):
    """A colleague's out_dir (its owner alone writes to it): one line naming the user and the folder, exit code 1,
    before any data is prepared; nothing is made in it."""
    locked = tmp_path / "shared"
    locked.mkdir()
    locked.chmod(0o555)
    cache = tmp_path / "cache"
    code, _, err = as_other_user(
        lambda: _train_py("experiment=cpu_smoke", f"out_dir={locked}", f"trainer.data_cache_dir={cache}")
    )
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"ckv: error: out_dir={str(locked)!r} is not writable by user ")
    assert lines[0].endswith(f"(Permission denied: {str(locked)!r}); give a folder you can write to: out_dir=...")
    assert list(locked.iterdir()) == [] and not cache.exists()
    if "by user nobody " in lines[0]:
        assert_documented(lines[0].replace(str(tmp_path), "/data"))


def test_seq_len_shorter_than_the_window_is_refused():
    """A sequence in which no compressor window completes trains without compression: refused in one line."""
    with pytest.raises(ConfigError) as e:
        train_config(["experiment=cpu_smoke", "data.seq_len=3"])
    assert_documented(error_message(str(e.value)))
    train_config(["experiment=cpu_smoke", "data.seq_len=4"])  # one window completes
    train_config(["experiment=cpu_smoke", "attention=full", "data.seq_len=3"])  # nothing to complete


@pytest.mark.parametrize(
    "attention, kv_heads",
    [("w8s8", 1), ("w8s8_kv2", 2), ("w8s8_kv4", 4), ("w8s8_kv8", 8), ("full_kv1", 1), ("full_kv4", 4), ("full", 8)],
)
def test_paper_kv_head_ablation_builds_its_kv_heads(attention, kv_heads):
    """The paper's KV-head ablation (paper_variants, paper_full) builds the count each option means (``full``:
    Qwen3-0.6B's own 8), in the parameter shapes and in both fields of the config.json it saves."""
    cfg = train_config(["experiment=paper_base", f"attention={attention}"] + USER_DATA)
    model_cfg = cfg.model.build(cfg.attention, data_vocab_size=151_669)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    assert {p.shape for n, p in model.named_parameters() if n.endswith(("k_proj.weight", "v_proj.weight"))} == {
        (kv_heads * model_cfg.head_dim, model_cfg.d_model)
    }
    saved = model_cfg.to_dict()
    assert (saved["n_kv_heads"], saved["attention"]["kv_heads"] or saved["n_kv_heads"]) == (kv_heads, kv_heads)


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "attention=w8s44",
            "ckv: error: In 'config': Could not find 'attention/w8s44'; choose one of ['deepseek_v4",
        ),
        ("limt=4", "ckv: error: limt is not a setting (Key 'limt' is not in struct); check its spelling"),
        (  # the default attention is full: a compressor's field is not one of its settings
            "attention.window=4",
            "ckv: error: attention.window is not a field of attention.kind='full'; it takes ['kind', 'impl', ",
        ),
        (  # a real setting the composed data file leaves out: the "+" that adds it, not "check its spelling"
            "data=lookup_split data.lookup.distinct_queries=true",
            "ckv: error: data.lookup.distinct_queries is a setting the composed config does not list (its config file "
            "leaves it at the default): add it with +data.lookup.distinct_queries=VALUE, or set it in an experiment",
        ),
        (
            "data=lookup_split data.lookup.distinct_querie=true",
            "ckv: error: data.lookup.distinct_querie is not a setting (Key",
        ),
    ],
)
def test_hydra_errors_are_one_line(tmp_path, override, line, monkeypatch, capsys):
    """Hydra's own errors (an unknown option, an unknown key) as one line: no search path; a "+key" hint only for
    a ``TrainConfig`` field the composed files leave out."""
    code, _, err = run_script("train.py", [*override.split(), f"out_dir={tmp_path}"], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(line), err
    assert ("+" in lines[0]) == ("a setting the composed config does not list" in line)


def _run_entry(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout
    )


def test_missing_data_path_is_named_in_one_line_from_a_shell(tmp_path):
    """``python train.py`` in a fresh interpreter, as a user runs it, for the error tests above that run it in this
    process (``run_script``): a value left ``???`` is one line naming the key, exit code 1, and no run folder."""
    proc = _run_entry(["experiment=paper_base", f"out_dir={tmp_path}"])
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "ckv: error: data.shards.path is not set (it is marked ??? in the config): add data.shards.path=... on the "
        "command line"
    ], proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_multirun_two_strides(tmp_path, cache_dir, monkeypatch, capsys):
    code, _, err = run_script(
        "train.py",
        [
            "-m",
            "experiment=cpu_smoke",
            "data=lookup_split",
            "data.seq_len=66",  # cpu_smoke's 64 is shorter than the split task's longest example
            "attention=w8s8",
            "attention.stride=4,8",
            "trainer.max_steps=3",
            "trainer.val_every=0",
            f"out_dir={tmp_path}",
            "wandb.enabled=false",
            f"trainer.data_cache_dir={cache_dir}",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 0, err[-3000:]
    runs = sorted(p for p in (tmp_path / "cpu_smoke").iterdir() if p.is_dir())
    assert [p.name for p in runs] == [
        f"attention.stride={s},attention=w8s8,data.seq_len=66,data=lookup_split,trainer.max_steps=3,seed=0"
        for s in (4, 8)
    ]
    for stride, run in zip((4, 8), runs):
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert (saved["attention"]["stride"], saved["attention"]["window"]) == (stride, 8)
        assert saved["data"]["kind"] == "lookup"
        assert (run / "model" / "model.safetensors").is_file() and read_metrics(run)[-1]["step"] == 3


@pytest.mark.smoke
def test_cpu_smoke_experiment(cpu_smoke_run):
    """CI's end-to-end run: python train.py experiment=cpu_smoke (shipped corpus, compressed W4/S4, wandb offline;
    run once per session by tests/conftest.py, whose run tests/eval/test_cli.py evaluates)."""
    proc = cpu_smoke_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = proc.out_dir / "cpu_smoke" / "seed=0"
    records = read_metrics(run)
    train_loss = [r["loss"] for r in records if "loss" in r]
    assert train_loss[-1] < train_loss[0] and any("val_loss" in r for r in records)
    outputs = {"config.yaml", "run_info.jsonl", "metrics.jsonl", "checkpoints", "model", "wandb"}
    assert outputs <= {p.name for p in run.iterdir()}
    assert (run / "model" / "tokenizer.json").is_file()
    assert "eta" in proc.stderr and "tok/s" in proc.stderr
    assert "gcc" not in proc.stdout + proc.stderr  # DeepSpeed's libaio probe stays quiet


def test_a_run_folder_another_user_can_not_write_is_one_line(tmp_path):
    """A colleague's run folder, trained again (resumed) by another user: one line naming the folder, not a
    traceback from the run lock."""
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o555)
    code, _, err = as_other_user(lambda: _train_py("experiment=cpu_smoke", f"hydra.run.dir={run}"))
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"ckv: error: the run folder {str(run)!r} is not writable by user ")
    assert lines[0].endswith(
        f"(Permission denied: {str(run)!r}); train into a folder you can write to: out_dir=... or name=..."
    )
    assert list(run.iterdir()) == []
    if "by user nobody " in lines[0]:
        assert_documented(lines[0].replace(str(tmp_path), "/data"))
