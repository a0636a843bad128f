"""Training the lightning indexer (trainer.indexer, ckv.train.indexer, docs/training.md): the loss against a hand
computation from the joint softmax, the indexer learning (recall far above a random indexer's), no LM-loss
gradient reaching it and its loss reaching nothing else, evaluation untouched, training runs (logged, the dense
warm-up holding everything but the indexers still, dense training moving everything while attending every entry,
exact resume, activation checkpointing unchanged), one-line config errors and the deepseek_v4_csa_sparse option."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ckv import Transformer
from ckv.attention.indexer import (
    WORKING_BYTES,
    IndexQueries,
    chunked_top_k,
    entry_logits,
    index_scores,
    index_working_bytes,
    kl_working_bytes,
    query_chunk,
    top_k,
)
from ckv.attention.reference import joint_attention_reference
from ckv.config import ConfigError
from ckv.data.synthetic import LookupSequences
from ckv.geometry import visible_entries
from ckv.train import TrainConfig, read_metrics, train
from ckv.train.indexer import (
    IndexerTraining,
    IndexerTrainingConfig,
    indexer_loss,
    indexer_parameters,
    indexer_recall,
    recall_queries,
)
from tests.helpers import LargestTensor, small_config
from tests.train.helpers import base_config, train_config

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
    # two index heads of 2 dims reading one coordinate each, weights +1 and -1: scores relu(k_0) - relu(k_1)
    queries = IndexQueries(torch.eye(2).reshape(1, 1, 2, 2), torch.tensor([[[1.0, -1.0]]]))
    keys = (2**0.5 * torch.tensor([[0.3, 0.0], [0.0, 1.0], [2.0, 0.0]]))[None].requires_grad_()
    scores = index_scores(queries, keys, q_start=3, stride=1)
    assert scores[0, 0].tolist() == pytest.approx([0.3, -1.0, 2.0], rel=1e-6)
    selected = torch.tensor([[[2, 0]]])
    logits = torch.einsum("hd,ed->he", q[0, 0], kc[0, :, 0]) / 2  # (2 heads, 3 entries), scale 1/sqrt(4)
    local = (q[0, 0] @ k[0, 0, 0] / 2)[:, None]  # (2, 1)
    for dense, keep in ((True, [0, 1, 2]), (False, [0, 2])):
        _, lse = joint_attention_reference(
            q, kc, kc, k, k, stride=1, local_window=1, q_start=3, sinks=sinks, selected=None if dense else selected
        )
        loss = indexer_loss(q, kc, lse, queries, keys, None if dense else selected, q_start=3, stride=1)
        recall = indexer_recall(q, kc, lse, selected, q_start=3, stride=1, topk=2, dense=dense)
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


def _listed(selected: torch.Tensor, n_entries: int) -> torch.Tensor:
    listed = torch.zeros(*selected.shape[:2], n_entries + 1, dtype=torch.bool)
    listed.scatter_(-1, torch.where(selected < 0, n_entries, selected), True)
    return listed[..., :n_entries]


def previous_loss_and_recall(q, kc, lse, scores, selected, topk, dense):
    """The implementation before the chunked one (every (query, head, entry) logit at once), kept as the oracle:
    the KL, and the per-query recall (B, T) with the queries whose selection binds."""
    visible = torch.isfinite(scores.detach())  # (B, T, E)
    chosen = _listed(selected, kc.shape[1]) & visible
    attended = visible if dense else chosen
    logits = entry_logits(q, kc)  # (B, T, H, E)
    mass = torch.exp(logits - lse[..., None]).masked_fill(~attended[:, :, None], 0.0).sum(2)
    total = mass.sum(-1, keepdim=True)
    rows = attended.any(-1) & (total[..., 0] > 0)
    target = mass / total.clamp_min(1e-30)
    masked = scores.masked_fill(~attended, float("-inf")).masked_fill(~rows[..., None], 0.0)
    log_q = torch.log_softmax(masked, dim=-1).masked_fill(~attended, 0.0)
    kl = (torch.xlogy(target, target) - target * log_q).sum(-1)
    loss = kl[rows].sum() / rows.sum().clamp_min(1)
    with torch.no_grad():
        unselected = visible & ~attended
        extra = logits.masked_fill(~unselected[:, :, None], float("-inf"))
        dense_lse = torch.logsumexp(torch.cat([lse[..., None], extra], dim=-1), dim=-1)
        p = torch.exp(logits - dense_lse[..., None]).masked_fill(~visible[:, :, None], 0.0).sum(2)
        heaviest = _listed(top_k(p.masked_fill(~visible, float("-inf")), topk), kc.shape[1])
        caught = (p * (heaviest & chosen)).sum(-1) / (p * heaviest).sum(-1).clamp_min(1e-30)
    return loss, caught, visible.sum(-1) > topk


def _layer_inputs(T: int, q_start: int, stride: int = 4, seed: int = 0):
    """A layer's queries, entries and index queries/keys over T queries at grid positions ``q_start ..`` (every
    entry they see), index queries with a gradient; ties at 0 after the ReLU are common (2 index heads)."""
    g = torch.Generator().manual_seed(seed)
    B, H, KV, D, Hi, Di = 2, 4, 2, 8, 2, 8
    E = (q_start + T) // stride
    q, kc = torch.randn(B, T, H, D, generator=g), torch.randn(B, E, KV, D, generator=g)
    k = torch.randn(B, T, KV, D, generator=g)
    queries = IndexQueries(
        torch.randn(B, T, Hi, Di, generator=g).requires_grad_(), torch.randn(B, T, Hi, generator=g).requires_grad_()
    )
    keys = torch.randn(B, E, Di, generator=g).requires_grad_()
    return q, kc, k, queries, keys


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "sparse"])
@pytest.mark.parametrize("chunk", [1, 5, 13, None])
def test_the_chunked_loss_and_gradients_equal_the_previous_implementation(dense, chunk):
    """The KL and the indexer's gradients (index queries, head weights, keys) equal the previous formulas over
    every (query, head, entry) logit within 1e-5, for query chunks not dividing T; with a sample as large as the
    binding queries the recall is the previous one."""
    T, q_start, stride, topk = 37, 3, 4, 3
    q, kc, k, queries, keys = _layer_inputs(T, q_start)
    scores = index_scores(queries, keys, q_start, stride)
    selected = top_k(scores.detach(), topk)
    _, lse = joint_attention_reference(
        q, kc, kc, k, k, stride=stride, local_window=1, q_start=q_start, selected=None if dense else selected
    )
    want, caught, binding = previous_loss_and_recall(q, kc, lse, scores, selected, topk, dense)
    want_grads = torch.autograd.grad(want, [queries.q, queries.w, keys])
    got = indexer_loss(q, kc, lse, queries, keys, None if dense else selected, q_start, stride, chunk=chunk)
    got_grads = torch.autograd.grad(got, [queries.q, queries.w, keys])
    assert got.item() == pytest.approx(want.item(), rel=1e-5) and want.item() > 0
    for g, w in zip(got_grads, want_grads):
        assert w.abs().max() > 0 and (g - w).abs().max() <= 1e-5 * w.abs().max()
    recall = indexer_recall(q, kc, lse, selected, q_start, stride, topk, dense, sample=T, chunk=chunk)
    assert binding.sum() > 20 and recall.item() == pytest.approx(caught[binding].mean().item(), rel=1e-5)


def test_at_top_1_the_sparse_stage_loss_is_zero_and_the_warm_up_loss_is_not():
    """docs/training.md: one selected entry holds all of both distributions' mass, so the KL over the selected set
    is 0 with no gradient to the indexer (make selection's top-1 arm: its indexer is the warm-up's fit)."""
    T, q_start, stride = 37, 3, 4
    q, kc, k, queries, keys = _layer_inputs(T, q_start)
    selected = top_k(index_scores(queries, keys, q_start, stride).detach(), 1)
    for dense in (True, False):
        _, lse = joint_attention_reference(
            q, kc, kc, k, k, stride=stride, local_window=1, q_start=q_start, selected=None if dense else selected
        )
        loss = indexer_loss(q, kc, lse, queries, keys, None if dense else selected, q_start, stride)
        grads = torch.autograd.grad(loss, [queries.q, queries.w, keys])
        biggest = max(g.abs().max().item() for g in grads)
        assert (loss.item() > 0.1 and biggest > 0) if dense else (loss.item() == 0 and biggest == 0), dense


@pytest.mark.parametrize("topk", [1, 2])
def test_in_make_selection_s_regime_the_sparse_stage_trains_the_indexer(topk):
    """issue 40: make selection's sparse arm (select_wide, conf/study/selection.yaml's top-2) in its sparse stage,
    one training forward of two of its sequences: at top-2 the KL over the selected entries and the indexer's
    gradient are not zero, so the indexer keeps learning there; at top-1 (the previous design) both are zero."""
    cfg = train_config(
        ["experiment=select_wide", "attention=deepseek_v4_csa_sparse", f"attention.selection.topk={topk}"]
    )
    lookup, T = cfg.data.lookup, cfg.data.seq_len
    stream = LookupSequences(lookup, lookup.format(0), T, seed=0, split=0, rank=0, world_size=1)
    ids = torch.from_numpy(np.stack([stream.next()[0] for _ in range(2)]))  # (2, T)
    torch.manual_seed(0)
    model = Transformer(cfg.model.build(cfg.attention, lookup.format(0).vocab_size)).train()
    ix = cfg.trainer.indexer.resolved(cfg.trainer.max_steps, True)
    hooks = IndexerTraining(model, ix)
    sparse_step = ix.dense_stage  # the first step of sparse training
    assert not hooks.attends_densely(sparse_step) and hooks.attends_densely(sparse_step - 1)
    hooks.start(dense=False)
    model(ids)
    loss, recall = hooks.finish()
    grads = torch.autograd.grad(loss, indexer_parameters(model), allow_unused=True)
    biggest = max(0.0 if g is None else g.abs().max().item() for g in grads)
    # the selection binds: the last query sees T // S entries, more than the top-k it keeps, so the recall is
    # measured there (it is NaN when no query's selection binds) and is a share
    stride = cfg.attention["stride"]
    assert visible_entries(T - 1, stride) == T // stride > topk == cfg.attention["selection"]["topk"]
    assert math.isfinite(recall.item()) and 0 <= recall.item() <= 1
    if topk == 1:
        assert loss.item() == 0 and biggest == 0
    else:
        assert loss.item() > 0 and biggest > 0


def test_the_recall_is_measured_on_an_evenly_spaced_sample_of_binding_queries():
    """``recall_queries`` picks ``sample`` distinct binding queries from the first to the last; the recall is the
    previous per-query recall averaged over them (every sequence of the batch)."""
    T, q_start, stride, topk = 37, 3, 4, 3
    q, kc, k, queries, keys = _layer_inputs(T, q_start, seed=1)
    scores = index_scores(queries, keys, q_start, stride)
    selected = top_k(scores.detach(), topk)
    _, lse = joint_attention_reference(q, kc, kc, k, k, stride=stride, local_window=1, q_start=q_start)
    _, caught, binding = previous_loss_and_recall(q, kc, lse, scores, selected, topk, dense=True)
    rows = recall_queries(T, kc.shape[1], q_start, stride, topk, sample=6)
    first, last = binding[0].nonzero()[0, 0].item(), T - 1
    assert rows.tolist()[0] == first and rows.tolist()[-1] == last and len(set(rows.tolist())) == 6
    assert binding[:, rows].all() and (rows.diff() >= (last - first) // 5 - 1).all()  # evenly spaced
    recall = indexer_recall(q, kc, lse, selected, q_start, stride, topk, dense=True, sample=6, chunk=4)
    assert recall.item() == pytest.approx(caught[:, rows].mean().item(), rel=1e-5)
    assert recall_queries(T, kc.shape[1], q_start, stride, topk, sample=T).tolist() == list(range(first, T))
    assert len(recall_queries(T, topk, q_start, stride, topk, sample=8)) == 0  # no more entries than top-k


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "sparse"])
def test_no_tensor_spans_every_query_and_entry(dense):
    """At T = 1,024 queries and E = 256 entries, with 16-query chunks: no op of the selection, the KL (forward
    and backward) or the recall produces a tensor of B * T * E / 4 elements or more (the largest are the inputs
    (B, T, H, D), then a chunk's (B, 16, H, E))."""
    T, q_start, stride, topk, chunk = 1024, 0, 4, 8, 16
    q, kc, k, queries, keys = _layer_inputs(T, q_start)
    B, E, H = q.shape[0], kc.shape[1], q.shape[2]
    lse = torch.randn(B, T, H)
    whole = B * T * E  # one (B, T, E) tensor; the previous implementation made (B, T, H, E) ones
    with LargestTensor() as seen:
        selected = chunked_top_k(
            lambda t0, t1, n: index_scores(queries.span(t0, t1), keys[:, :n], q_start + t0, stride),
            T,
            E,
            q_start,
            stride,
            topk,
            chunk,
        )
        loss = indexer_loss(q, kc, lse, queries, keys, None if dense else selected, q_start, stride, chunk=chunk)
        loss.backward()
        indexer_recall(q, kc, lse, selected, q_start, stride, topk, dense, sample=64, chunk=chunk)
    assert seen.largest < whole / 4, (seen.largest, whole)
    assert keys.grad.abs().sum() > 0


def test_the_working_bytes_bound_the_chunk():
    """The chunk a budget allows: the largest whose working bytes fit it (at least one query)."""
    per_query = kl_working_bytes(2, 1, 4, 2, 300)
    assert kl_working_bytes(2, 8, 4, 2, 300) == 8 * per_query
    assert index_working_bytes(2, 8, 2, 300) == 8 * index_working_bytes(2, 1, 2, 300)
    c = query_chunk(per_query, 10**6)
    assert c * per_query <= WORKING_BYTES < (c + 1) * per_query
    assert query_chunk(per_query, 3) == 3 and query_chunk(10 * WORKING_BYTES, 100) == 1
    assert query_chunk(per_query, 100, chunk=7) == 7


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
        indexer = {"recipe": "sparse", **trainer.pop("indexer", {"warmup_steps": 2})}  # stages as given, else 0
        d["trainer"].update({"max_steps": 4, "save_every": 2, "keep_last": 3, "indexer": indexer, **trainer})
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


def test_three_stages_dense_training_then_the_warm_up_then_sparse(run):
    """``dense_steps=2, warmup_steps=2`` of 6 steps: steps 1-2 train the whole model (every weight moves), steps
    3-4 only the indexers (the model's groups at lr 0, its weights unchanged), steps 5-6 the whole model again."""
    cfg = run("three", max_steps=6, indexer={"dense_steps": 2, "warmup_steps": 2})
    rows = _rows(cfg.run_dir)
    assert [r["lr"] == 0 for r in rows] == [False, False, True, True, False, False]
    assert all(r["indexer_loss"] > 0 for r in rows)

    def weights(step: int) -> dict:
        name = f"step_{step:08d}"
        return load_file(str(Path(cfg.run_dir) / "checkpoints" / name / "weights" / "model.safetensors"))

    step2, step4, step6 = weights(2), weights(4), weights(6)
    for name, value in step4.items():
        assert torch.equal(value, step2[name]) != (".indexer." in name), name  # the warm-up moved the indexers only
    assert not torch.equal(step6["layers.0.self_attn.q_proj.weight"], step4["layers.0.self_attn.q_proj.weight"])
    torch.manual_seed(cfg.seed)  # the run's initial weights: dense training moved every matrix
    init = Transformer(cfg.model.build(cfg.attention, data_vocab_size=step2["embed_tokens.weight"].shape[0]))
    assert not any(torch.equal(v, init.state_dict()[k]) for k, v in step2.items() if k.endswith("weight"))


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
        (
            dict(dense_steps=4, warmup_steps=4),
            SPARSE,
            r"trainer.indexer.dense_steps=4 \+ trainer.indexer.warmup_steps=4 covers all trainer.max_steps=8",
        ),
        (dict(dense_steps=8), SPARSE, r"trainer.indexer.dense_steps=8 covers all trainer.max_steps=8"),
        (dict(dense_steps=-1), SPARSE, r"trainer.indexer.dense_steps=-1 must be an integer >= 0"),
        (dict(weight=-1.0), SPARSE, r"trainer.indexer.weight=-1.0 must be a finite number >= 0"),
        (dict(warmup_steps=-1), SPARSE, r"trainer.indexer.warmup_steps=-1 must be an integer >= 0"),
        (dict(weight="1"), SPARSE, r"trainer.indexer.weight='1' must be a finite number"),
        (dict(steps=1), SPARSE, r"unknown trainer.indexer field\(s\) \['steps'\]"),
        (dict(recipe="v4"), SPARSE, r"trainer.indexer.recipe='v4' is not allowed; choose one of"),
    ],
)
def test_bad_configs_fail_with_one_line(tmp_path, indexer, attention, needle):
    d = base_config(tmp_path / "bad", tmp_path / "cache")
    d["attention"] = attention
    d["trainer"]["indexer"] = {"recipe": "sparse", **indexer}  # the stages as given (else 0)
    with pytest.raises(ConfigError, match=needle) as err:
        TrainConfig.from_dict(d)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "given, has_indexer, expected",
    [
        (dict(), True, (600, 200)),
        (dict(recipe="cotrain"), True, (800, 0)),
        (dict(recipe="v32"), True, (760, 15)),  # a fractional share (1.5%); the warm-up a fifteenth of sparse (225)
        (dict(recipe="sparse"), True, (0, 0)),
        (dict(dense_steps=50), True, (50, 200)),  # a stage given keeps its steps, the other takes its share
        (dict(recipe="cotrain", warmup_steps=7), True, (800, 7)),
        (dict(), False, (0, 0)),  # no lightning indexer (or oracle selection): no stages
    ],
)
def test_the_recipe_gives_each_stage_left_unset_its_share_of_max_steps(given, has_indexer, expected):
    resolved = IndexerTrainingConfig(**given).resolved(1000, has_indexer)
    assert (resolved.dense_steps, resolved.warmup_steps) == expected
    assert resolved.resolved(1000, has_indexer) == resolved
    with pytest.raises(ValueError, match="not resolved"):
        _ = IndexerTrainingConfig().dense_stage


def test_the_sparse_option_composes_with_the_indexer_trained_by_default():
    cfg = train_config(["experiment=cpu_smoke", "attention=deepseek_v4_csa_sparse"])
    assert cfg.attention["selection"] == {"topk": 4, "heads": 2, "head_dim": 16, "by": "indexer", "quant": "none"}
    assert cfg.attention["query"] == {"lora_rank": 32}
    max_steps = cfg.trainer.max_steps
    ix = cfg.trainer.indexer  # DeepSeek-V3.2's three stages by default: 60% dense, 20% warm-up, 20% sparse
    assert (ix.weight, ix.recipe, ix.dense_steps, ix.warmup_steps) == (
        1.0,
        "three_stage",
        max_steps * 60 // 100,
        max_steps * 20 // 100,
    )
    plain = train_config(["experiment=cpu_smoke", "attention=deepseek_v4_csa"])
    assert {k: v for k, v in cfg.attention.items() if k not in ("selection", "query")} == {
        k: v for k, v in plain.attention.items() if k not in ("selection", "query")
    }
