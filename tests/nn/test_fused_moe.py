"""onca.nn.MoEExperts against the Hugging Face expert modules it replaces (same state dict, same
routing), forward and backward: Mixtral's SwiGLU experts and GPT-OSS's clamped, biased experts."""

from __future__ import annotations

import pytest
import torch

from onca.nn import MoEExperts
from tests.helpers import SCALE, assert_close

# (tokens, hidden, intermediate, experts, top_k)
SHAPE = {"cpu": (11, 32, 24, 4, 2), "gpu": (4096, 2880, 2880, 32, 4)}[SCALE]


def hf_experts(family, tokens, hidden, inter, experts, top_k):
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        config = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                               num_experts_per_tok=top_k)
        return config, MixtralExperts(config)
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                          num_experts_per_tok=top_k)
    return config, GptOssExperts(config)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_matches_hugging_face_experts(device, family):
    tokens, hidden, inter, experts, top_k = SHAPE
    config, theirs = hf_experts(family, *SHAPE)
    theirs = theirs.to(device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    mine = MoEExperts.from_config(config, device=device)
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(tokens, hidden, device=device)
    logits = torch.randn(tokens, experts, device=device)
    weights, index = torch.topk(torch.softmax(logits, -1), top_k, -1)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ws = [weights.clone().requires_grad_(True) for _ in range(2)]
    out = mine(xs[0], index, ws[0])
    ref = theirs(xs[1], index, ws[1])
    assert_close(out, ref, torch.float32, "out")
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout)
    assert_close(xs[0].grad, xs[1].grad, torch.float32, "dx")
    assert_close(ws[0].grad, ws[1].grad, torch.float32, "d_top_k_weights")
    theirs_by_name = dict(theirs.named_parameters())
    assert set(theirs_by_name) == {name for name, _ in mine.named_parameters()}
    for name, p in mine.named_parameters():
        assert_close(p.grad, theirs_by_name[name].grad, torch.float32, f"d_{name}")


def test_gpt_oss_config_without_swiglu_alpha():
    """transformers before 5.2x keeps GPT-OSS's alpha in the experts (1.702), not in the config."""
    from types import SimpleNamespace

    config = SimpleNamespace(model_type="gpt_oss", num_local_experts=4, intermediate_size=8, hidden_size=16)
    experts = MoEExperts.from_config(config)
    assert (experts.alpha, experts.limit, experts.layout) == (1.702, 7.0, "gpt_oss")
    config.swiglu_alpha, config.swiglu_limit = 1.5, 6.0
    assert (MoEExperts.from_config(config).alpha, MoEExperts.from_config(config).limit) == (1.5, 6.0)


def test_bad_construction():
    with pytest.raises(ValueError, match="layout must be one of"):
        MoEExperts(4, 8, 8, layout="switch")
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        MoEExperts(4, 0, 8)
