"""Checks of Onca-patched Hugging Face models under FSDP2 (``fully_shard``) on two ranks (run by
``test_fsdp.py``): the same model, weights and batches with and without ``onca.apply``, sharded the
same way; losses and gradients compared, sharded checkpoints saved and loaded.

Each rank trains on its own batch (data parallel); FSDP2 all-gathers the parameters per layer and
reduce-scatters the gradients, so a wrong gradient on either rank shows in the other's next loss.
"""

from __future__ import annotations

import math
import tempfile

import torch
import torch.distributed as dist

import onca
from onca.integrations.transformers import presets
from tests.helpers import SCALE

STEPS = 2
BATCH, SEQ = (2, 12) if SCALE == "cpu" else (4, 512)
LR = 1e-2


def _config(model_type: str):
    if SCALE == "cpu":
        return presets.tiny_config(model_type, hidden_size=32, layers=2, vocab_size=96, heads=2, kv_heads=1)
    return presets.tiny_config(model_type, hidden_size=512, layers=4, vocab_size=32000, heads=8, kv_heads=4)


def _build(model_type: str, device, patched: bool, *, mixed: bool, checkpointing: bool, shard: str = "layers"):
    """The model (same seed every time), patched or not, then sharded: each decoder layer and the
    root; ``shard="head"``: the LM head too on its own; ``"tied"``: the input embedding and the (tied)
    head together in one group."""
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(_config(model_type), dtype=torch.float32).to(device)
    if patched:
        onca.apply(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed
              else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    if shard == "head":
        fully_shard(model.lm_head, mp_policy=policy)
    elif shard == "tied":  # a tied head and its embedding: one group (FSDP2 refuses them apart)
        fully_shard([model.model.embed_tokens, model.lm_head], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.train()
    return model


def _batches(rank: int, vocab: int, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [torch.randint(3, vocab, (BATCH, SEQ), generator=g).to(device) for _ in range(STEPS)]


def _train(model, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step, and the full gradients after the first backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step, tokens in enumerate(data):
        labels = tokens.clone()
        labels[:, :3] = -100  # a masked prompt
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def _compare(model_type: str, rank: int, device, *, mixed: bool, checkpointing: bool, shard: str = "layers",
             reference_shard: str = "layers"):
    config = _config(model_type)
    data = _batches(rank, config.vocab_size, device)
    ref_losses, ref_grads = _train(_build(model_type, device, False, mixed=mixed, checkpointing=checkpointing,
                                          shard=reference_shard), data)
    model = _build(model_type, device, True, mixed=mixed, checkpointing=checkpointing, shard=shard)
    assert model._onca_kernels.get("fused_linear_cross_entropy") == 1, model._onca_kernels
    losses, grads = _train(model, data)
    onca.unapply(model)
    # fp32: reduction order only; bf16 parameters: each matmul rounds (the interpreter truncates).
    loss_tol = 2e-2 if mixed else 2e-4
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert math.isfinite(a) and abs(a - b) <= loss_tol * max(1.0, abs(b)), (
            f"step {step}: onca loss {a:.6f} vs Hugging Face {b:.6f} (rank {rank})")
    assert grads.keys() == ref_grads.keys()
    grad_tol = 5e-2 if mixed else 1e-4
    for name, g in grads.items():
        ref = ref_grads[name]
        err = (g - ref).norm().item() / max(ref.norm().item(), 1e-12)
        assert err <= grad_tol, f"{name}: gradient relative error {err:.3g} > {grad_tol} (rank {rank})"


def _check_checkpoint(rank, device):
    """Sharded checkpoints (torch.distributed.checkpoint) of a patched model: the same keys as the
    unpatched model's, saved and loaded into a fresh patched model that then computes the same loss."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    plain = _build("qwen3", device, False, mixed=False, checkpointing=False)
    model = _build("qwen3", device, True, mixed=False, checkpointing=False)
    assert list(get_model_state_dict(model)) == list(get_model_state_dict(plain))
    assert list(model.state_dict()) == list(plain.state_dict())
    data = _batches(rank, _config("qwen3").vocab_size, device)
    _train(model, data[:1])  # one step: the weights are no longer the seed's
    path = [tempfile.mkdtemp(prefix="onca-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dcp.save(get_model_state_dict(model), checkpoint_id=path[0])
    fresh = _build("qwen3", device, True, mixed=False, checkpointing=False)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path[0])
    set_model_state_dict(fresh, state)
    saved, loaded = get_model_state_dict(model), get_model_state_dict(fresh)
    for name, p in loaded.items():
        assert torch.equal(p.to_local(), saved[name].to_local()), name
    with torch.no_grad():
        tokens = data[-1]
        a = model(input_ids=tokens, labels=tokens).loss
        b = fresh(input_ids=tokens, labels=tokens).loss
    assert torch.equal(a, b), (a.item(), b.item())


CHECKS = {
    # fp32 parameters (tight parity), the head in its own FSDP group: Onca reads its weight without
    # calling it, so the loss runs as a forward method of that group.
    "llama_fp32_head_sharded_alone": lambda r, d: _compare("llama", r, d, mixed=False, checkpointing=False,
                                                           shard="head", reference_shard="head"),
    # bf16 mixed precision and gradient checkpointing, the (tied) head with the root.
    "qwen3_tied_bf16_checkpointing": lambda r, d: _compare("qwen3", r, d, mixed=True, checkpointing=True),
    # A tied head grouped with its embedding (the group FSDP2 requires when they are not the root's).
    "qwen3_tied_head_embedding_group": lambda r, d: _compare("qwen3", r, d, mixed=False, checkpointing=False,
                                                             shard="tied", reference_shard="tied"),
    # Mixture of experts in fp32 (bf16 rounding can flip a top-k routing choice between runs).
    "qwen3_moe_fp32": lambda r, d: _compare("qwen3_moe", r, d, mixed=False, checkpointing=False),
    "checkpoint": _check_checkpoint,
}
