"""eval.py's ``mitigation`` group (``ckv.eval.mitigation``, docs/mitigation.md): shift ensembling against the runs
written out by hand, scored exactly as the unmitigated model; dual-offset compression through eval equal to a model
built with ``attention.dual_offset``, and on transformers' DeepSeek-V4 equal to ckv's own layer; a model without
compressed attention gets a note and its unmitigated result; the cost from ckv's accounting against the real cache;
every bad setting one ``ckv: error:`` line before the weights load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckv import ModelConfig, Transformer
from ckv.config import ConfigError
from ckv.eval import LookupSpec, RunOptions, build_task, evaluate, load_ckv_model
from ckv.eval.lookup import lookup_summary
from ckv.eval.mitigation import MitigationSpec, config_cost, plan_mitigation, spread_shifts
from ckv.eval.models import CkvLastLogits
from ckv.eval.registry import task_type
from ckv.eval.scoring import COMBINES, score_next_token
from ckv.geometry import num_entries

from .helpers import ReadingOracle, make_run, run_eval, save_tiny, tiny_deepseek_v4, tiny_qwen3

COMPRESSED = dict(kind="compressed", window=4, stride=4, local_window=2)
FAST = dict(progress=False, plots=False, stats={"n_bootstrap": 50, "n_permutations": 50})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mitigation")
    sparse = dict(COMPRESSED, selection={"topk": 2, "heads": 2, "head_dim": 8})
    return {
        "compressed": make_run(root, attention=COMPRESSED, name="w4s4"),
        "full": make_run(root, attention=dict(kind="full"), name="full"),
        "sparse": make_run(root, attention=sparse, name="sparse"),
    }


def outcome(run: Path, mitigation: dict, tmp_path: Path, name: str) -> tuple[dict, list[dict]]:
    """Evaluate ``run`` on 8 base examples of the lookup (mod 8) with ``mitigation``: the report and the rows."""
    model = load_ckv_model(run)
    spec = LookupSpec(name=name, modulus=8, n_base=8)
    options = RunOptions(**FAST, out_dir=str(tmp_path / name), mitigation=mitigation)
    results, out = evaluate(model, spec, options)
    rows = (out / "results.csv").read_text().splitlines()
    return results["results"], rows


# ---- the spec --------------------------------------------------------------------------------------------------
def test_the_spec_resolves_defaults_and_refuses_settings_of_another_mitigation() -> None:
    assert MitigationSpec.parse({"name": "shift_ensemble"}).describe() == {
        "name": "shift_ensemble", "shifts": 2, "combine": "mean_logprob", "also": ()
    }  # fmt: skip
    assert MitigationSpec().describe() == {"name": "none"}
    assert spread_shifts(2, 8) == (0, 4) and spread_shifts(3, 8) == (0, 2, 5) and spread_shifts(4, 4) == (0, 1, 2, 3)
    for bad, named in [
        ({"name": "dual_offset", "shifts": 2}, "mitigation.shifts is a setting of shift_ensemble"),
        ({"name": "shift_ensemble", "offset": 1}, "mitigation.offset is a setting of dual_offset"),
        ({"name": "shift_ensemble", "shifts": -1}, "mitigation.shifts=-1 must be an integer >= 1"),
        ({"name": "shift_ensemble", "shifts": 0}, "mitigation.shifts=0 must be an integer >= 1"),
        ({"name": "shift_ensemble", "combine": "vote"}, "mitigation.combine='vote' is not allowed"),
        ({"name": "shift_ensemble", "also": ["vote"]}, "mitigation.also='vote' is not allowed"),
        ({"name": "shift_ensemble", "also": ["mean_logprob"]}, "mitigation.also=['mean_logprob'] repeats a rule"),
        ({"name": "shift_ensemble", "also": ["max_confidence"] * 2}, "mitigation.also=['max_confidence', 'max_"),
        ({"name": "dual_offset", "also": ["max_confidence"]}, "mitigation.also is a setting of shift_ensemble"),
        ({"name": "dual_offset", "offset": 0}, "mitigation.offset=0 must be an integer >= 1"),
        ({"name": "fix"}, "mitigation.name='fix' is not allowed"),
        ({"name": "none", "typo": 1}, "unknown mitigation field(s) ['typo']"),
    ]:
        with pytest.raises(ConfigError) as e:
            MitigationSpec.parse(bad)
        assert str(e.value).startswith(named) and "\n" not in str(e.value), (bad, str(e.value))


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(MitigationSpec)])
@pytest.mark.parametrize("value", ["x", 1.5, True, -1, [1], {"a": 1}])
def test_every_field_refuses_wrong_types_in_one_line(field: str, value: Any) -> None:
    name = {"shifts": "shift_ensemble", "combine": "shift_ensemble", "also": "shift_ensemble", "offset": "dual_offset"}
    name = name.get(field, "none")
    with pytest.raises(ConfigError) as e:
        MitigationSpec.parse({"name": name, field: value} if field != "name" else {"name": value})
    assert f"mitigation.{field}" in str(e.value) and "\n" not in str(e.value)


# ---- shift ensembling ------------------------------------------------------------------------------------------
def _gapless(prompt: np.ndarray, gap: set) -> list[int]:
    return [int(t) for t in prompt if int(t) not in gap]


@pytest.mark.parametrize("padding", ["prefix", "in_sequence"])
@pytest.mark.parametrize("task_kind", ["lookup", "needle"])
def test_a_shifted_prompt_moves_its_target_keeping_length_query_and_records(task_kind: str, padding: str) -> None:
    """Every prompt moved by every s: the same length, the same tokens from the separator on (the query stays put),
    the same records in the same order (only gap tokens move), and the target record s positions later mod S."""
    from ckv.eval import NeedleSpec

    spec = (
        LookupSpec(modulus=8, n_base=16, stride=4, padding=padding)
        if task_kind == "lookup"
        else NeedleSpec(context_tokens=160, n_records=20, modulus=8, stride=4, padding=padding, prompts_per_residue=4)
    )
    task = build_task(spec, _words_facts())
    c, S = task.codec, 4
    gap = {c.pad_id, *c.filler_ids}
    moved = 0
    for i in range(len(task.prompts)):
        p, t = np.asarray(task.prompts[i]), int(task.table["target_position"][i])
        record = p[t : t + c.record_len]
        for s in range(1, S):
            q = task.shifted_prompt(i, s)
            assert len(q) == len(p)
            assert np.array_equal(q[len(q) - task.query_span :], p[len(p) - task.query_span :])
            assert _gapless(q, gap) == _gapless(p, gap)
            new = [j for j in range(len(q) - c.record_len) if (j - t - s) % S == 0 and abs(j - t) < S
                   and np.array_equal(q[j : j + c.record_len], record)]  # fmt: skip
            assert new, (i, s)
            moved += new[0] > t
    assert moved  # most moves push gap tokens to the front


@pytest.mark.parametrize("combine", ["mean_logprob", "max_confidence"])
@torch.no_grad()
def test_the_ensemble_is_the_runs_combined_by_hand(combine: str) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", attention=COMPRESSED)).eval()
    inner = CkvLastLogits(model)
    prompts = [np.random.default_rng(i).integers(3, model.config.vocab_size, 21) for i in range(5)]
    variants = [[np.roll(p, k) for p in prompts] for k in (1, 3)]  # any other versions of equal length
    other = next(rule for rule in COMBINES if rule != combine)
    scores = score_next_token(inner, prompts, np.zeros((5, 1), dtype=np.int64), batch_size=2, progress=False,
                              variants=variants, combine=combine, also=[other])  # fmt: skip
    assert list(scores.also) == [other]
    for b in range(5):
        runs = [torch.log_softmax(inner(torch.as_tensor(v[b])[None])[0], -1) for v in (prompts, *variants)]
        for rule, got in ((combine, scores), (other, scores.also[other])):  # both rules from the same runs
            if rule == "mean_logprob":
                expected = torch.log_softmax(sum(runs) / 3, -1)
            else:
                expected = max(runs, key=lambda r: r.max().item())
            assert got.top1[b] == int(expected.argmax())
            assert got.probs[b, 0] == pytest.approx(float(expected[0].exp()), rel=1e-5)


def test_two_shifts_recover_a_weak_phase() -> None:
    """A reader that gives up (uniform logits) when the queried key sits at phase 3 mod 4: unmitigated, phase 3 is
    at 0%; with the shifts 0 and 2 every prompt has one confident run, and both rules answer every phase."""
    task = build_task(LookupSpec(modulus=8, n_base=16, stride=4), _words_facts())
    weak = ReadingOracle(task.codec.n_values + 200, wrong=lambda pos: pos % 4 == 3)

    def shy(ids: torch.Tensor) -> torch.Tensor:  # uniform where the reader would be wrong
        logits = weak(ids)
        for b, row in enumerate(ids.tolist()):
            if row.index(row[-1]) % 4 == 3:
                logits[b] = 0.0
        return logits

    plain = task.report(task.evaluate(shy, progress=False))
    assert plain["phase"]["groups"][3]["accuracy"] == 0.0
    for combine in ("mean_logprob", "max_confidence"):
        report = task.report(task.evaluate(shy, progress=False, shifts=(0, 2), combine=combine))
        assert report["headline"]["mean"] == 1.0, combine


def _words_facts():
    from ckv.eval import ModelFacts
    from ckv.eval.vocab import HFTokenizer

    from .helpers import word_tokenizer

    tok = HFTokenizer(word_tokenizer())
    return ModelFacts(name="words", vocab_size=len(tok.tok) + 200, tokenizer=tok, kind="hf", max_len=4096, stride=4)


def test_one_shift_is_the_unmitigated_evaluation_and_groups_keep_their_labels(runs, tmp_path) -> None:
    plain, plain_rows = outcome(runs["compressed"], {"name": "none"}, tmp_path, "plain")
    one, one_rows = outcome(runs["compressed"], {"name": "shift_ensemble", "shifts": 1}, tmp_path, "one")
    two, two_rows = outcome(runs["compressed"], {"name": "shift_ensemble", "shifts": 2}, tmp_path, "two")
    assert one_rows == plain_rows and one["headline"] == plain["headline"]  # one shift: the prompt itself
    columns = plain_rows[0].split(",").index("phase")  # the group label: the target's phase unshifted
    assert [r.split(",")[: columns + 1] for r in two_rows] == [r.split(",")[: columns + 1] for r in plain_rows]
    assert two["mitigation"]["settings"] == {"shifts": [0, 2], "combine": "mean_logprob", "also": []}
    cost = two["mitigation"]["cost"]
    assert cost["flops_ratio"] == pytest.approx(2.0) and cost["kv_ratio"] == pytest.approx(2.0)  # 2 equal prompts


def test_other_rules_from_the_same_runs_are_their_own_evaluations(runs, tmp_path) -> None:
    """``also``: the other rule scored from the ensemble's runs is, column for column and headline for headline, the
    evaluation with that rule as its own; the combine rule's rows and report are unchanged beside it."""
    both, both_rows = outcome(runs["compressed"], {"name": "shift_ensemble", "also": ["max_confidence"]}, tmp_path, "a")
    mean, mean_rows = outcome(runs["compressed"], {"name": "shift_ensemble"}, tmp_path, "b")
    most, most_rows = outcome(
        runs["compressed"], {"name": "shift_ensemble", "combine": "max_confidence"}, tmp_path, "c"
    )
    header, most_header = both_rows[0].split(","), most_rows[0].split(",")
    assert header[-2:] == ["correct_max_confidence", "p_answer_max_confidence"]
    assert [",".join(r.split(",")[:-2]) for r in both_rows] == mean_rows
    for name in ("correct", "p_answer"):
        got = [r.split(",")[header.index(f"{name}_max_confidence")] for r in both_rows[1:]]
        assert got == [r.split(",")[most_header.index(name)] for r in most_rows[1:]], name
    assert both["headline"] == mean["headline"] and both["also"]["max_confidence"]["headline"] == most["headline"]
    assert both["mitigation"]["cost"] == mean["mitigation"]["cost"] and "also" not in mean
    assert both["mitigation"]["settings"]["also"] == ["max_confidence"]
    lines = lookup_summary(both)
    at = lines.index("combined by max_confidence (the same runs):")
    assert lines[:at] == lookup_summary(mean) and lines[at + 1 :] == [f"  {x}" for x in lookup_summary(most)]


# ---- dual-offset compression -----------------------------------------------------------------------------------
def test_dual_offset_through_eval_is_the_model_built_with_the_option(runs, tmp_path) -> None:
    report, rows = outcome(runs["compressed"], {"name": "dual_offset"}, tmp_path, "dual")
    assert report["mitigation"]["settings"] == {"offset": 2}  # half the stride
    model = load_ckv_model(runs["compressed"])
    d = model.config.to_dict()
    built = Transformer(ModelConfig.from_dict({**d, "attention": {**d["attention"], "dual_offset": 2}})).eval()
    built.load_state_dict(model.module.state_dict())
    spec = LookupSpec(name="direct", modulus=8, n_base=8)
    direct = dataclasses.replace(model, module=built, logits=CkvLastLogits(built))
    _, out = evaluate(direct, spec, RunOptions(**FAST, out_dir=str(tmp_path / "direct")))
    assert (out / "results.csv").read_text().splitlines() == rows


def test_the_cost_is_ckv_accounting_and_matches_the_real_cache(runs, tmp_path) -> None:
    model = load_ckv_model(runs["compressed"])
    spec = LookupSpec(modulus=8, n_base=8)
    kind = task_type(spec)
    built = kind.build(spec, model, None)
    plan = plan_mitigation(MitigationSpec(name="dual_offset"), kind, model, built)
    cost = config_cost(plan, model.config)
    T = cost["tokens"]
    for config, key in ((model.config, "kv_bytes_unmitigated"), (plan.config, "kv_bytes")):
        module = Transformer(config).eval()
        cache = module.new_cache(1)
        with torch.no_grad():
            module.hidden_states(torch.zeros(1, T, dtype=torch.long), cache)
        assert cache.nbytes()["total"] / 2 == pytest.approx(cost[key])  # fp32 cache, bf16 accounting
    assert cost["flops_ratio"] > 1.0 and cost["kv_ratio"] > 1.0


def test_a_model_without_compressed_attention_gets_a_note_and_its_unmitigated_result(runs, tmp_path) -> None:
    plain, plain_rows = outcome(runs["full"], {"name": "none"}, tmp_path, "full_plain")
    for mitigation in ({"name": "shift_ensemble"}, {"name": "dual_offset"}):
        report, rows = outcome(runs["full"], mitigation, tmp_path, f"full_{mitigation['name']}")
        assert rows == plain_rows
        record = report["mitigation"]
        assert record["applied"] is False and record["cost"] is None
        assert "has no compressed attention" in record["note"] and "unmitigated result" in record["note"]


@pytest.mark.parametrize(
    "run,args,line",
    [
        ("compressed", ["mitigation=shift_ensemble", "mitigation.shifts=5"],
         "ckv: error: mitigation.shifts=5 is more than the model's stride 4"),
        ("compressed", ["mitigation=shift_ensemble", "mitigation.shifts=-1"],
         "ckv: error: mitigation.shifts=-1 must be an integer >= 1"),
        ("compressed", ["mitigation=dual_offset", "mitigation.offset=4"],
         "ckv: error: mitigation.offset=4 must be < the model's stride 4"),
        ("compressed", ["mitigation=shift_ensemble", "task=probe_synthetic"],
         "ckv: error: mitigation=shift_ensemble moves each prompt's target across the phases, but task kind 'probe'"),
        ("compressed", ["mitigation=shift_ensemble", "mitigation.offset=1"],
         "ckv: error: mitigation.offset is not a setting"),
        ("sparse", ["mitigation=dual_offset"], "ckv: error: attention.dual_offset: dual-offset compression attends"),
        ("compressed", ["mitigation=dual_offset", "analysis=knockout"],
         "ckv: error: mitigation=dual_offset applies to eval.py's tasks, not to analysis=knockout"),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_before_the_weights_load(runs, capsys, monkeypatch, run, args, line) -> None:
    import ckv.eval.runner as runner

    if "analysis=knockout" not in args:  # refused before any weights load
        monkeypatch.setattr(runner.ModelSource, "load", lambda *a, **k: pytest.fail("weights loaded"))
    code, _, err = run_eval([f"model.path={runs[run]}", *args, "limit=4", "progress=false"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(line), err


def test_the_dry_run_prints_the_cost(runs, capsys) -> None:
    code, out, _ = run_eval(
        [f"model.path={runs['compressed']}", "mitigation=dual_offset", "dry_run=true", "task.modulus=8"], capsys
    )
    assert code == 0
    assert "mitigation dual_offset (offset 2): prefill FLOPs" in out and "(ckv.flops" in out


# ---- transformers' models ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tiny_deepseek_v4, tmp_path_factory.mktemp("v4") / "v4")


@torch.no_grad()
def test_dual_offset_on_deepseek_v4_equals_ckvs_layer_and_chunks_equal_one_forward() -> None:
    """transformers' V4 with its compressors patched (``DeepseekV4Dual``) against ckv's V4 layer with
    ``attention.dual_offset`` (dense: index_topk above the entries), in one forward and by chunked prefill."""
    from transformers import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    from ckv.attention import build_attention, compressed_layers
    from ckv.eval.hf_models import DeepseekV4Dual, dual_offset_v4
    from ckv.io.hf import attention_from_deepseek_v4, deepseek_v4_attention_config
    from tests.helpers import CSA, randomise, tiny_v4_config

    torch.manual_seed(0)
    cfg = tiny_v4_config(CSA, index_topk=1024)
    attn = v4.DeepseekV4Attention(cfg, 0).eval()
    randomise(attn)
    plain = attention_from_deepseek_v4(attn)
    d = deepseek_v4_attention_config(cfg, CSA).to_dict()
    dual_cfg = ModelConfig.from_dict({**d, "attention": {**d["attention"], "selection": None, "dual_offset": 2}})
    ckv_dual = compressed_layers(build_attention(dual_cfg, 0))[0].eval()
    kept = {k: v for k, v in plain.state_dict().items() if not k.startswith("indexer.")}
    ckv_dual.load_state_dict(kept)

    class Holder(torch.nn.Module):  # dual_offset_v4 patches every DeepseekV4Attention below a module
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

    holder = Holder()
    assert dual_offset_v4(holder, {CSA: 2}) == 1 and isinstance(attn.compressor, DeepseekV4Dual)
    B, T = 2, 27
    x = torch.randn(B, T, cfg.hidden_size)

    def v4_forward(start: int, stop: int, cache=None) -> torch.Tensor:
        pos = torch.arange(start, stop)[None].expand(B, -1)
        rotary = v4.DeepseekV4RotaryEmbedding(cfg)
        xs = x[:, start:stop]
        emb = {t: rotary(xs, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        mask = create_sliding_window_causal_mask(
            config=cfg, inputs_embeds=xs, attention_mask=None, cache=cache, position_ids=pos
        )
        return attn(xs, emb, pos, mask, cache=cache)[0]

    out = v4_forward(0, T)
    assert (out - ckv_dual(x)).abs().max().item() <= 1e-5
    with DeepseekV4Dual.off(holder):
        assert (v4_forward(0, T) - plain(x)).abs().max().item() <= 1e-5  # switched off: the unpatched layer
    cache = DynamicCache(config=cfg)
    chunks = [v4_forward(a, b, cache) for a, b in ((0, 6), (6, 7), (7, 19), (19, T))]
    assert (torch.cat(chunks, 1) - out).abs().max().item() <= 1e-5


def test_deepseek_v4_runs_both_mitigations_through_eval(v4_dir, capsys, tmp_path) -> None:
    common = [f"model.path={v4_dir}", "model=hf", "model.stride=4", "task.n_records=16", "task.n_demos=4",
              "task.modulus=8", "limit=4", "progress=false", "plots=false", "stats.n_bootstrap=50",
              "stats.n_permutations=50"]  # fmt: skip
    for m in ("shift_ensemble", "dual_offset"):
        code, out, err = run_eval([*common, f"mitigation={m}", f"out_dir={tmp_path / m}"], capsys)
        assert code == 0, err
        record = json.loads((tmp_path / m / "results.json").read_text())["results"]["mitigation"]
        assert record["applied"] and record["cost"]["flops_ratio"] > 1.0 and record["cost"]["kv_ratio"] > 1.0
        assert f"mitigation {m}" in out


def test_deepseek_v4_refuses_dual_offset_where_top_k_binds(tmp_path, capsys) -> None:
    from functools import partial

    path = save_tiny(partial(tiny_deepseek_v4, index_topk=4), tmp_path / "v4_top4")
    capsys.readouterr()  # saving prints its progress
    code, _, err = run_eval(
        [f"model.path={path}", "model=hf", "model.stride=4", "task.n_records=16", "task.modulus=8",
         "mitigation=dual_offset", "limit=4"], capsys,
    )  # fmt: skip
    assert code == 2 and err.startswith("ckv: error: mitigation=dual_offset on DeepSeek-V4 needs dense selection")


def test_a_transformers_model_without_compression_refuses_dual_offset(tmp_path, capsys) -> None:
    path = save_tiny(tiny_qwen3, tmp_path / "qwen")
    capsys.readouterr()  # saving prints its progress
    args = [f"model.path={path}", "model=hf", "task.n_records=16", "task.modulus=8", "limit=4", "progress=false"]
    code, _, err = run_eval([*args, "model.stride=4", "mitigation=dual_offset"], capsys)
    assert code == 2 and err.startswith("ckv: error: mitigation=dual_offset pools a second set of windows")
    code, out, _ = run_eval([*args, "mitigation=shift_ensemble", f"out_dir={tmp_path / 'o'}"], capsys)
    assert code == 0 and "has no compressed attention" in out


def test_moved_entries_of_deepseek_v4_are_in_its_memory_estimate(v4_dir) -> None:
    from ckv.eval.hf_models import hf_memory, inspect_hf_model

    facts = inspect_hf_model(v4_dir, stride=4)
    T = 101
    plain, dual = hf_memory(facts), hf_memory(facts, dual_offsets={"compressed_sparse_attention": 2})
    added = sum(g.count * (g2.cache(T) - g.cache(T)) for g, g2 in zip(plain.layers, dual.layers))
    per_entry = facts.config.head_dim * 4  # fp32
    assert added == num_entries(T + 2, 4) * per_entry * facts.config.num_hidden_layers
