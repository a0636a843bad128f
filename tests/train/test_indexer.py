"""Training the lightning indexer (trainer.indexer, ckv.train.indexer, docs/training.md): the loss against a hand
computation from the joint softmax, the indexer learning (recall far above a random indexer's), no LM-loss
gradient reaching it and its loss reaching nothing else, evaluation untouched, training runs (logged, the dense
warm-up holding everything but the indexers still, dense training moving everything while attending every entry,
exact resume, activation checkpointing unchanged), one-line config errors and the deepseek_v4_csa_sparse option."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckv import Transformer
from ckv.attention.reference import joint_attention_reference
from ckv.config import ConfigError
from ckv.train import TrainConfig, read_metrics, train
from ckv.train.indexer import IndexerTraining, IndexerTrainingConfig, indexer_loss_and_recall
from tests.helpers import small_config
from tests.train.helpers import base_config
from tests.train.test_entry import _train_config

SPARSE = dict(
    kind="compressed", window=8, stride=4, local_window=2, kv_heads=1, selection=dict(topk=2, heads=2, head_dim=16)
)


def test_the_loss_is_the_kl_to_the_joint_softmax_mass_on_the_entries():
    """One query, two heads with different sinks: the target is each head's probability of each entry in its ONE
    softmax over entries, local key and sink, summed over heads and renormalised over the KL's entries (all
    visible ones in the warm-up, the selected ones after); per-head softmaxes over the entries alone differ."""
    torch.manual_seed(0)
    q, kc, k = torch.randn(1, 1, 2, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 1, 1, 4)
    sinks = torch.tensor([2.5, -1.0])
    scores = torch.tensor([[[0.3, -1.0, 2.0]]], requires_grad=True)
    selected = torch.tensor([[[2, 0]]])
    logits = torch.einsum("hd,ed->he", q[0, 0], kc[0, :, 0]) / 2  # (2 heads, 3 entries), scale 1/sqrt(4)
    local = (q[0, 0] @ k[0, 0, 0] / 2)[:, None]  # (2, 1)
    for dense, keep in ((True, [0, 1, 2]), (False, [0, 2])):
        _, lse = joint_attention_reference(
            q, kc, kc, k, k, stride=1, local_window=1, q_start=3, sinks=sinks, selected=None if dense else selected
        )
        loss, recall = indexer_loss_and_recall(q, kc, lse, scores, selected, topk=2, dense=dense)
        # the softmax the layer computed: over the attended entries (all, or the selected), local key and sink
        joint = torch.softmax(torch.cat([logits[:, keep], local, sinks[:, None]], 1), 1)[:, : len(keep)]
        p = joint.sum(0) / joint.sum()
        want = (p * (p.log() - torch.log_softmax(scores[0, 0, keep], 0))).sum()
        assert torch.allclose(loss, want, atol=1e-6), dense
        alone = torch.softmax(logits[:, keep], 1).sum(0) / 2  # the pitfall: a softmax over entries alone
        assert (alone - p).abs().max() > 0.05
        mass = torch.softmax(torch.cat([logits, local, sinks[:, None]], 1), 1)[:, :3].sum(0)  # every entry's
        heaviest = mass.topk(2).indices.tolist()
        caught = mass[[i for i in heaviest if i in (0, 2)]].sum() / mass[heaviest].sum()
        assert recall.item() == pytest.approx(caught.item(), rel=1e-5)


def test_the_indexer_learns_from_its_loss():
    """The dense warm-up's recipe on one layer whose main weights stay fixed, on a tiny task with structure to
    learn: inputs are a fixed vector plus small noise (as hidden states share a mean direction), so which entries a
    query attends to depends mostly on their relative position (RoPE) and a little on content. 60 Adam steps on
    the KL over every visible entry (about 1 s) take the indexer's recall from a random indexer's level to far
    above it."""
    torch.manual_seed(0)
    att = {**SPARSE, "selection": dict(topk=3, heads=4, head_dim=16)}
    cfg = small_config(att, n_layers=1, n_heads=4, n_kv_heads=1, init_std=0.2)
    layer = Transformer(cfg).layers[0].self_attn.train()
    with torch.no_grad():
        layer.q_norm.weight.fill_(3.0)  # sharper attention than at init
    offset = torch.randn(cfg.d_model)
    hooks = IndexerTraining(layer, IndexerTrainingConfig())
    opt = torch.optim.Adam(layer.indexer.parameters(), lr=1e-2)
    held_out = 0.3 * torch.randn(8, 48, cfg.d_model, generator=torch.Generator().manual_seed(1)) + offset

    def recall() -> float:
        hooks.start(dense=True)
        layer(held_out)
        return hooks.finish()[1].item()

    # a random selection of 3 catches 3 / visible of the heaviest entries' mass on average (binding queries)
    visible = torch.tensor([(t + 1) // 4 for t in range(48)])
    random = (3 / visible[visible > 3]).mean().item()
    before = recall()
    for _ in range(60):
        hooks.start(dense=True)
        layer(0.3 * torch.randn(8, 48, cfg.d_model) + offset)
        loss, _ = hooks.finish()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = recall()
    assert before < random + 0.1 and after > random + 0.3 and after > 0.75, (random, before, after)


def test_no_lm_gradient_reaches_the_indexer_and_its_loss_reaches_nothing_else():
    torch.manual_seed(0)
    model = Transformer(small_config(SPARSE))
    ids = torch.randint(0, 64, (2, 30))
    names = [n for n, _ in model.named_parameters()]
    assert any(".indexer." in n for n in names)
    model(ids).logsumexp(-1).mean().backward()
    lm = {n: p.grad for n, p in model.named_parameters()}
    assert all((lm[n] is None) == (".indexer." in n) for n in names)  # the LM loss: everything but the indexer
    model.zero_grad()
    hooks = IndexerTraining(model, IndexerTrainingConfig())
    hooks.start()
    lm_loss = model(ids).logsumexp(-1).mean()
    (lm_loss + hooks.finish()[0]).backward()
    for n, p in model.named_parameters():  # the indexer's loss adds its gradients and changes no other
        if ".indexer." in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert torch.equal(p.grad, lm[n]), n


def test_evaluation_and_decoding_are_untouched_by_the_hooks():
    """In eval mode (or without gradients) the hooks neither record nor change the selection, also in warm-up."""
    torch.manual_seed(0)
    model = Transformer(small_config(SPARSE)).eval()
    ids = torch.randint(0, 64, (1, 30))
    with torch.no_grad():
        plain = model(ids)
    hooks = IndexerTraining(model, IndexerTrainingConfig(warmup_steps=5))
    hooks.start(dense=True)
    with torch.no_grad():
        assert torch.equal(model(ids), plain)
    model.train()
    with torch.no_grad():
        assert torch.equal(model(ids), plain)
    loss, recall = hooks.finish()
    assert loss.item() == 0 and recall.isnan()
    hooks.start(dense=True)
    dense = model(ids)  # training with gradients, warm-up: every visible entry attended
    assert not torch.allclose(dense, plain) and hooks.finish()[0].item() > 0
    hooks.remove()
    assert torch.equal(model(ids), plain)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    """``run(name, **trainer)``: a 4-step CPU run of a 2-layer sparse model on the lookup task, 2 of them dense
    warm-up, a checkpoint every 2 steps (module-scoped: tests share runs by name); ``trainer`` overrides."""
    root = tmp_path_factory.mktemp("indexer")
    done: dict[str, TrainConfig] = {}

    def make(name: str, **trainer) -> TrainConfig:
        d = base_config(root / name, root / "cache")
        d["attention"] = SPARSE
        d["trainer"].update(
            {"max_steps": 4, "save_every": 2, "keep_last": 3, "indexer": {"warmup_steps": 2}, **trainer}
        )
        return TrainConfig.from_dict(d)

    def run_once(name: str, **trainer) -> TrainConfig:
        if name not in done:
            cfg = make(name, **trainer)
            train(cfg)
            done[name] = cfg
        return done[name]

    run_once.make = make
    return run_once


def _rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(Path(run_dir)) if "loss" in r]


def test_training_logs_the_indexer_and_the_warm_up_trains_it_alone(run):
    cfg = run("warmup")
    rows = _rows(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["indexer_loss"] > 0 and 0 <= r["indexer_recall"] <= 1 for r in rows)
    assert [r["lr"] == 0 for r in rows] == [True, True, False, False]  # the model's groups: held during warm-up
    step2 = load_file(str(Path(cfg.run_dir) / "checkpoints" / "step_00000002" / "weights" / "model.safetensors"))
    torch.manual_seed(cfg.seed)  # the run's initial weights
    vocab = step2["embed_tokens.weight"].shape[0]
    init = Transformer(cfg.model.build(cfg.attention, data_vocab_size=vocab)).state_dict()
    for name, value in step2.items():
        same = torch.equal(value, init[name])
        assert same != (".indexer." in name), name  # after the warm-up: only the indexers moved
    final = load_file(str(Path(cfg.run_dir) / "model" / "model.safetensors"))
    assert not torch.equal(final["layers.0.self_attn.q_proj.weight"], step2["layers.0.self_attn.q_proj.weight"])


def test_dense_training_trains_the_whole_model_attending_every_visible_entry(run):
    warm, dense, sparse = (
        _rows(run(name, indexer=stages).run_dir)
        for name, stages in (
            ("warmup", {"warmup_steps": 2}),
            ("dense", {"dense_steps": 2}),
            ("sparse", {"warmup_steps": 0}),
        )
    )
    # the first step's forward has the initial weights: dense training and the warm-up both attend every visible
    # entry (the same LM loss and the same KL set), sparse training only the top-2
    assert (dense[0]["loss"], dense[0]["indexer_loss"]) == (warm[0]["loss"], warm[0]["indexer_loss"])
    assert dense[0]["loss"] != sparse[0]["loss"]
    assert all(r["lr"] > 0 for r in dense)  # nothing held still
    cfg = run("dense", indexer={"dense_steps": 2})
    step2 = load_file(str(Path(cfg.run_dir) / "checkpoints" / "step_00000002" / "weights" / "model.safetensors"))
    torch.manual_seed(cfg.seed)
    vocab = step2["embed_tokens.weight"].shape[0]
    init = Transformer(cfg.model.build(cfg.attention, data_vocab_size=vocab)).state_dict()
    assert not any(torch.equal(value, init[name]) for name, value in step2.items() if name.endswith("weight"))


def test_resume_with_the_indexer_is_exact(run):
    straight = run("warmup")
    split = run.make("split", stop_at_step=1)
    train(split)
    resumed = run.make("split")
    train(resumed)
    key = ("step", "loss", "lr", "indexer_loss", "indexer_recall")
    assert [tuple(r[k] for k in key) for r in _rows(straight.run_dir)] == [
        tuple(r[k] for k in key) for r in _rows(resumed.run_dir)
    ]
    wa = load_file(str(Path(straight.run_dir) / "model" / "model.safetensors"))
    wb = load_file(str(Path(resumed.run_dir) / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_activation_checkpointing_gives_the_same_losses_with_the_indexer(run):
    """The replayed forward runs the hooks again (the warm-up's dense attention included); its terms are dropped."""
    base = _rows(run("warmup").run_dir)
    checkpointed = _rows(run("full", activation_checkpointing="full").run_dir)
    for key in ("loss", "indexer_loss"):
        assert [r[key] for r in checkpointed] == pytest.approx([r[key] for r in base], abs=1e-5), key


@pytest.mark.parametrize(
    "indexer, attention, needle",
    [
        (dict(weight=0.0), SPARSE, r"trainer.indexer.weight=0.0 would leave the lightning indexer .* untrained"),
        (dict(warmup_steps=3), dict(SPARSE, selection=None), r"trainer.indexer.warmup_steps=3 is a dense stage"),
        (dict(dense_steps=3), dict(SPARSE, selection=None), r"trainer.indexer.dense_steps=3 is a dense stage"),
        (dict(dense_steps=2, warmup_steps=2), SPARSE, r"warmup_steps=2 and dense_steps=2 are two dense stages"),
        (dict(dense_steps=8), SPARSE, r"trainer.indexer.dense_steps=8 covers all trainer.max_steps=8"),
        (dict(dense_steps=-1), SPARSE, r"trainer.indexer.dense_steps=-1 must be an integer >= 0"),
        (dict(weight=-1.0), SPARSE, r"trainer.indexer.weight=-1.0 must be a finite number >= 0"),
        (dict(warmup_steps=-1), SPARSE, r"trainer.indexer.warmup_steps=-1 must be an integer >= 0"),
        (dict(weight="1"), SPARSE, r"trainer.indexer.weight='1' must be a finite number"),
        (dict(steps=1), SPARSE, r"unknown trainer.indexer field\(s\) \['steps'\]"),
    ],
)
def test_bad_configs_fail_with_one_line(tmp_path, indexer, attention, needle):
    d = base_config(tmp_path / "bad", tmp_path / "cache")
    d["attention"] = attention
    d["trainer"]["indexer"] = indexer
    with pytest.raises(ConfigError, match=needle) as err:
        TrainConfig.from_dict(d)
    assert "\n" not in str(err.value)


def test_the_sparse_option_composes_with_the_indexer_trained_by_default():
    cfg = _train_config(["experiment=cpu_smoke", "attention=deepseek_v4_csa_sparse"])
    assert cfg.attention["selection"] == {"topk": 4, "heads": 2, "head_dim": 16, "by": "indexer"}
    assert cfg.attention["query"] == {"lora_rank": 32}
    assert (cfg.trainer.indexer.weight, cfg.trainer.indexer.warmup_steps) == (1.0, 0)
    plain = _train_config(["experiment=cpu_smoke", "attention=deepseek_v4_csa"])
    assert {k: v for k, v in cfg.attention.items() if k not in ("selection", "query")} == {
        k: v for k, v in plain.attention.items() if k not in ("selection", "query")
    }
