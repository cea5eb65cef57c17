"""A whole training step of a patched model captured in one CUDA graph and replayed: possible only
if no op synchronises with the host or allocates data-dependent shapes; the replays must follow
the eager run of a twin model step for step."""

from __future__ import annotations

import pytest
import torch

import onca
from onca.integrations.transformers.presets import tiny_config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

WARMUP, REPLAYS = 3, 4


def _setup(model_type):
    torch.manual_seed(0)
    config = tiny_config(model_type, hidden_size=256, layers=2, vocab_size=4096)
    model = onca.apply(transformers.AutoModelForCausalLM.from_config(config).cuda().train())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (4, 128), generator=g).cuda()

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_training_step_replays_in_a_cuda_graph(model_type):
    eager_step = _setup(model_type)
    expected = torch.stack([eager_step() for _ in range(WARMUP + REPLAYS)])

    step = _setup(model_type)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warmup = [step() for _ in range(WARMUP)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run: each replay runs one step
        static_loss = step()
    replayed = []
    for _ in range(REPLAYS):
        graph.replay()
        replayed.append(static_loss.clone())
    actual = torch.stack(warmup + replayed)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    assert actual[-1] < actual[0], "the replayed steps do not learn"
