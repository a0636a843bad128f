"""The call of a compressed layer's joint softmax as its hooks receive it, decoded in one place (``AttendCall``)."""

import ast
import inspect
from pathlib import Path

import torch

import ckv
from ckv import Transformer
from ckv.attention import AttendCall, JointAttention, compressed_layers
from tests.helpers import small_config, variant


def test_a_hook_on_attend_reads_the_layers_call():
    cfg = small_config(variant("w8s4"))
    model, T = Transformer(cfg).eval(), 21
    calls = []
    for layer in compressed_layers(model):
        layer.attend.register_forward_hook(lambda m, a, k, out: calls.append(AttendCall.decode(a, k)), with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (2, T)))
    assert len(calls) == cfg.n_layers
    for call in calls:
        assert (call.stride, call.q_start, call.selected) == (cfg.attention.stride, 0, None)
        assert call.q.shape[:2] == (2, T) and call.n_entries == T // cfg.attention.stride
        assert call.last_query == T - 1


def test_positional_and_keyword_calls_decode_alike_with_the_defaults():
    q, kc = torch.zeros(1, 5, 2, 4), torch.zeros(1, 3, 1, 4)
    selected = torch.zeros(1, 5, 1, dtype=torch.long)
    keywords = AttendCall.decode((), dict(q=q, kc=kc, vc=kc, k=q, v=q, stride=2, local_window=2))
    positional = AttendCall.decode((q, kc, kc, q, q), dict(stride=2, local_window=2))
    assert keywords == positional and (positional.q_start, positional.selected) == (0, None)
    later = AttendCall.decode((q, kc, kc, q, q), dict(stride=2, local_window=2, q_start=7, selected=selected))
    assert (later.q_start, later.last_query, later.selected is selected, later.n_entries) == (7, 11, True, 3)


def test_no_module_outside_the_attention_package_decodes_the_call_itself():
    """A hook's ``kwargs["stride"]``, ``kwargs.get("selected")``, ...: each of ``JointAttention.forward``'s
    arguments is read through ``AttendCall`` only."""
    arguments = set(inspect.signature(JointAttention.forward).parameters) - {"self"}
    src = Path(ckv.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        if path.parent.name == "attention":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "kwargs":
                key = getattr(n.slice, "value", None)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get":
                if isinstance(n.func.value, ast.Name) and n.func.value.id == "kwargs" and n.args:
                    key = getattr(n.args[0], "value", None)
            if key in arguments:
                found.append(f"{path.relative_to(src)}:{n.lineno}: {ast.unparse(n)}")
    assert not found, f"the attention call decoded outside ckv.attention (use AttendCall.decode): {found}"
