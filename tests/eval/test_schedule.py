"""Evaluation of a layer-scheduled model (``model.layers``): its phase stride, what its facts say, an ``impl``
override, the needle's memory plan and dual-offset compression, each following every layer's own attention (and,
under cross-layer KV sharing, a consumer its source's)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ckv import ModelConfig, Transformer
from ckv.attention import model_phase_stride
from ckv.config import ConfigError
from ckv.eval import LookupSpec, load_ckv_model
from ckv.eval.memory import ckv_model_memory, estimate
from ckv.eval.mitigation import MitigationSpec, config_cost, plan_mitigation
from ckv.eval.models import inspect_ckv_model
from ckv.eval.registry import task_type
from ckv.eval.runner import plot_title
from ckv.flops import flops_per_token

from .helpers import make_run

W4S4 = dict(kind="compressed", window=4, stride=4, local_window=4)
W2S2 = dict(W4S4, window=2, stride=2)
SLIDING = dict(kind="sliding", sliding_window=3)
# layer 0 a sliding window, layer 1 the run's attention (W4/S4), layer 2 a W2/S2 compressor of its own
SCHEDULE = [{"count": 1, "attention": SLIDING}, {"count": 1}, {"count": 1, "attention": W2S2}]


def scheduled(attention: dict = W4S4, layers: list = SCHEDULE) -> ModelConfig:
    return ModelConfig.from_preset("tiny", n_layers=len(layers), attention=attention, layers=layers)


@pytest.mark.parametrize(
    "attention, layers, stride",
    [
        (W4S4, None, 4),  # a uniform stack: its attention's stride, as before
        (W4S4, SCHEDULE, 4),  # strides 4 and 2: 4
        (W4S4, [{"count": 1}, {"count": 1, "attention": dict(W4S4, window=6, stride=6)}], 12),  # 4 and 6: 12
        (SLIDING, [{"count": 1}, {"count": 1, "attention": {"kind": "full"}}], None),  # no compressed layer
        (SLIDING, [{"count": 1, "kv": "source", "attention": W2S2}, {"count": 1, "kv": "shared"}], 2),  # its source's
        (SLIDING, [{"count": 1, "kv": "source", "attention": {"kind": "full"}}, {"count": 1, "kv": "shared"}], None),
    ],
)
def test_the_phase_stride_is_the_least_common_multiple_of_the_layers_strides(attention, layers, stride) -> None:
    config = ModelConfig.from_preset("tiny", n_layers=2 if layers is None else len(layers), attention=attention)
    if layers is not None:
        config = dataclasses.replace(config, layers=layers)
    assert model_phase_stride(config) == stride


def test_a_scheduled_runs_facts_describe_its_layers_and_impl_overrides_the_layers_that_run_it(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=W4S4, preset_overrides={"n_layers": 3, "layers": SCHEDULE})
    facts, _ = inspect_ckv_model(run, impl="reference")
    assert facts.stride == 4
    att = facts.info["attention"]
    assert att["kind"] == "1x sliding + 1x compressed + 1x compressed" and att["stride"] is None
    assert [(s["kind"], s["window"], s["stride"]) for s in att["layers"]] == [
        ("sliding", None, None),
        ("compressed", 4, 4),
        ("compressed", 2, 2),
    ]
    assert "(layers 1x sliding + 1x compressed + 1x compressed" in plot_title(facts)
    impls = ["auto", "reference", "reference"]  # the sliding layer does not run the reference: it keeps its own
    assert [facts.config.layer_attention(i).impl for i in range(3)] == impls
    model = load_ckv_model(run, device="cpu", impl="reference")
    assert [block.self_attn.impl for block in model.module.layers] == impls
    with pytest.raises(ConfigError, match="attention.kind='sliding' does not support attention.impl='flash'"):
        load_ckv_model(run, device="cpu", impl="flash")  # no layer runs it: the first layer says so, as before


def test_a_uniform_runs_facts_are_unchanged(tmp_path: Path) -> None:
    facts, _ = inspect_ckv_model(make_run(tmp_path, attention=W4S4))
    assert facts.info["attention"] == {"kind": "compressed", "window": 4, "stride": 4, "pooling": "gate"}


def test_the_memory_plan_sums_the_layers() -> None:
    """The schedule's cache is the sum of its layers' (each a third of the uniform stack of that layer's
    attention); its transients are its largest layer's."""
    config = scheduled()
    uniform = [ModelConfig.from_preset("tiny", n_layers=3, attention=a) for a in (SLIDING, W4S4, W2S2)]
    device = torch.device("cpu")
    mine = estimate(ckv_model_memory(config, device), 2, 200, 64)
    theirs = [estimate(ckv_model_memory(u, device), 2, 200, 64) for u in uniform]
    assert [(g.name, g.count) for g in ckv_model_memory(config, device).layers] == [
        ("sliding", 1),
        ("compressed", 1),
        ("compressed", 1),
    ]
    assert mine.cache == pytest.approx(sum(t.cache for t in theirs) / 3)
    assert mine.scores == max(t.scores for t in theirs) and mine.indexer == 0.0
    assert mine.cache < theirs[1].cache  # the W2/S2 and sliding layers hold more and less than W4/S4


def test_dual_offset_compression_moves_each_compressed_layer_by_half_its_stride(tmp_path: Path) -> None:
    run = make_run(tmp_path, attention=W4S4, preset_overrides={"n_layers": 3, "layers": SCHEDULE})
    model = load_ckv_model(run, device="cpu")
    spec = LookupSpec(modulus=4, n_base=4)
    kind = task_type(spec)
    built = kind.build(spec, model, None)
    plan = plan_mitigation(MitigationSpec(name="dual_offset"), kind, model, built)
    assert plan.config is not None
    assert plan.config.layer_attention(0) == model.config.layer_attention(0)  # the sliding layer as it was
    assert [plan.config.layer_attention(i).dual_offset for i in (1, 2)] == [2, 1]
    assert plan.settings() == {"offset": {"layer 1": 2, "layer 2": 1}}
    cost = config_cost(plan, model.config)
    for config, key in ((model.config, "kv_bytes_unmitigated"), (plan.config, "kv_bytes")):
        module = Transformer(config).eval()
        cache = module.new_cache(1)
        with torch.no_grad():
            module.hidden_states(torch.zeros(1, cost["tokens"], dtype=torch.long), cache)
        assert cache.nbytes()["total"] / 2 == pytest.approx(cost[key])  # fp32 cache, bf16 accounting
    with pytest.raises(ConfigError, match="mitigation.offset=2 must be < its smallest layer stride 2"):
        plan_mitigation(MitigationSpec(name="dual_offset", offset=2), kind, model, built)


def test_dual_offset_compression_of_a_kv_source_reaches_its_consumers(tmp_path: Path) -> None:
    """The source pools its moved grid too and publishes both sets; its consumers attend both (their accounting
    counts the moved entries, their cache stays their window): the plan's costs are the real cache's, and the
    mitigated model decodes as it runs in one forward."""
    layers = [{"count": 1, "kv": "source"}, {"count": 2, "kv": "shared", "attention": SLIDING}]
    run = make_run(tmp_path, attention=W4S4, preset_overrides={"n_layers": 3, "layers": layers})
    model = load_ckv_model(run, device="cpu")
    spec = LookupSpec(modulus=4, n_base=4)
    kind = task_type(spec)
    built = kind.build(spec, model, None)
    plan = plan_mitigation(MitigationSpec(name="dual_offset"), kind, model, built)
    assert [plan.config.layer_kv(i) for i in range(3)] == ["source", "shared", "shared"]
    assert plan.config.layer_attention(0).dual_offset == 2 and plan.config.layer_config(1).kv_source.origins == (0, 2)
    cost = config_cost(plan, model.config)
    theirs = flops_per_token(plan.config, cost["tokens"])  # the consumers' moved entries among the pairs
    assert theirs.attention > flops_per_token(model.config, cost["tokens"]).attention
    module = Transformer(plan.config).eval()
    cache, ids = module.new_cache(1), torch.randint(0, plan.config.vocab_size, (1, cost["tokens"]))
    with torch.no_grad():
        full = module(ids)
        parts = [module(ids[:, :5], cache)] + [module(ids[:, t : t + 1], cache) for t in range(5, ids.shape[1])]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.nbytes()["total"] / 2 == pytest.approx(cost["kv_bytes"])  # fp32 cache, bf16 accounting
