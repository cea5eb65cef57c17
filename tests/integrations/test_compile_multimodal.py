"""The multimodal families (and Pixtral's vision encoder) under ``torch.compile``: patched, they add no
graph break of their own, and their loss and gradients equal the patched model's eager run. Apart
from test_compile.py (the text families) so that each GPU shard fits one device call: the two took
more than 380 s together on an H200 (2026-11-28).
"""

from __future__ import annotations

import pytest
import torch

import onca
from onca.integrations.transformers import FAMILIES
from tests.integrations.test_compile import (
    COMPILED_FAMILIES,
    EVERY_KERNEL,
    _GraphRecorder,
    _loss_and_grads,
    assert_same_loss_and_grads,
)

transformers = pytest.importorskip("transformers")

# Built with an image as test_families.py builds them: Hugging Face's own vision paths break the
# graph in most of them (data-dependent shapes, ``.item()``), so the test holds Onca to adding no
# break of its own.
MULTIMODAL_FAMILIES = sorted(set(FAMILIES) - set(COMPILED_FAMILIES))


@pytest.mark.parametrize("model_type", MULTIMODAL_FAMILIES)
def test_patched_multimodal_family_adds_no_graph_break(model_type, device, monkeypatch):
    """Compiled with an image in its inputs, the patched model has no more graphs than the unpatched
    one (one where Hugging Face's model is one graph), every Onca op its eager forward calls is in
    them, and loss and gradients equal the patched model's eager run."""
    from onca.integrations.transformers import multimodal
    from onca.ops._contract import Op
    from tests.integrations.test_families import _build, _loss, skip_if_the_original_fails

    model, config = _build(model_type, torch.float32, device)
    for module in (model.config, config.get_text_config()):
        if getattr(module, "output_router_logits", False):  # see test_compile.NO_ROUTER_LOGITS
            module.output_router_logits = False
    generator = torch.Generator().manual_seed(1)
    inputs = {k: v.to(device) for k, v in multimodal.inputs(model_type, config, 1, 24, generator).items()}
    skip_if_the_original_fails(model_type, model, inputs)

    def step(_):
        return _loss(model_type, model, inputs)

    hf_graphs = _GraphRecorder()
    torch._dynamo.reset()
    torch.compile(step, backend=hf_graphs)(None)
    onca.apply(model, **EVERY_KERNEL)
    eager_ops = set()
    with monkeypatch.context() as patch:  # the ops the eager forward calls
        call = Op.__call__
        patch.setattr(Op, "__call__", lambda op, *args: eager_ops.add(op.name) or call(op, *args))
        with torch.no_grad():
            step(None)
    expected_loss, expected_grads = _loss_and_grads(model, step, None)
    torch._dynamo.reset()
    recorder = _GraphRecorder()
    compiled = torch.compile(step, backend=recorder, fullgraph=hf_graphs.graphs == 1)
    loss, grads = _loss_and_grads(model, compiled, None)

    # Fewer is allowed: a patched module can replace code that broke the graph (InternVL: 8 graphs
    # unpatched, 4 patched, transformers 5.23 on the CPU).
    assert recorder.graphs <= hf_graphs.graphs, f"Hugging Face: {hf_graphs.graphs} graphs, patched: {recorder.graphs}"
    assert eager_ops, "no Onca op ran"
    missing = sorted(eager_ops - recorder.onca_ops)
    assert not missing, f"Onca ops of the eager forward absent from the compiled graphs: {missing}"
    assert_same_loss_and_grads(loss, grads, expected_loss, expected_grads, device)
