"""torch.compile: the full and the compressed fast path (impl=torch) trace without graph breaks, and
trainer.compile=true trains with the same losses."""

from __future__ import annotations

import pytest
import torch

from ckv.config import ModelSpec
from ckv.model import Transformer
from ckv.train import train

from .helpers import losses

ATTENTIONS = {
    "full": {"kind": "full"},
    "compressed": {"kind": "compressed", "window": 8, "stride": 4, "impl": "torch"},
    "compressed_tail_sinks": {
        "kind": "compressed",
        "window": 8,
        "stride": 4,
        "impl": "torch",
        "local_window": "tail",
        "sink": True,
    },
}


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_model_compiles_without_graph_breaks(name):
    """fullgraph=True raises on any graph break; forward and backward match eager."""
    torch._dynamo.reset()
    config = ModelSpec.from_dict({"preset": "tiny"}).build(ATTENTIONS[name], data_vocab_size=64)
    torch.manual_seed(0)
    model = Transformer(config)
    model.check_token_ids = False  # the id check reads values (the trainer turns it off as well)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(ids)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(ids)
    ref.square().mean().backward()
    torch.testing.assert_close(out, ref)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)


@pytest.mark.slow
def test_trainer_compile_gives_the_same_losses(make_config, capsys):
    """trainer.compile=true (inductor) on a compressed model: the same loss curve to 1e-4; a line says so before
    the first (compiling) step."""
    torch._dynamo.reset()
    attention = ATTENTIONS["compressed"]
    eager = losses(train(make_config("eager", attention=attention, trainer={"max_steps": 6, "save_every": 0})))
    compiled = losses(
        train(make_config("compiled", attention=attention, trainer={"max_steps": 6, "save_every": 0, "compile": True}))
    )
    assert len(eager) == 6 and compiled == pytest.approx(eager, abs=1e-4)
    assert "trainer.compile=true: the model compiles during the first step" in capsys.readouterr().err
