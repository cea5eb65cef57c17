"""Fused linear GRPO benchmark: dapo aggregation, clipping 0.2/0.2, no KL term, old log-probs given."""

from __future__ import annotations

import torch

from onca.bench.ops._posttrain import benchmark, token_logps


def onca(p, inputs):
    from onca.ops.fused_linear_grpo import fused_linear_grpo

    i = inputs
    return lambda: fused_linear_grpo(i["hidden"], i["weight"], i["labels"], i["advantages"], i["old_logps"])


def reference(p, inputs):
    def eager(h, w, labels, adv, old):
        logp = token_logps(h, w, labels)
        mask = (labels != -100).float()
        coef_1 = torch.exp(logp - old)
        coef_2 = torch.clamp(coef_1, 0.8, 1.2)
        per = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
        return (per * mask).sum() / mask.sum().clamp(min=1)

    i = inputs
    return lambda: eager(i["hidden"], i["weight"], i["labels"], i["advantages"], i["old_logps"])


def liger(p, inputs):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    i = inputs
    mask = (i["labels"] != -100).long()

    def make(compiled):
        loss = LigerFusedLinearGRPOLoss(beta=0.0, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2,
                                        use_ref_model=False, compiled=compiled)
        return lambda: loss(i["hidden"], i["weight"], i["labels"].clamp(min=0), mask, i["advantages"],
                            old_per_token_logps=i["old_logps"])[0]

    # liger compiles its per-chunk loss with torch.compile, which fails on some PyTorch versions
    # (2.11: "sources must not be empty for symbol"): then its uncompiled chunks, as a user would run.
    compiled = make(True)
    try:
        compiled()
    except Exception:  # noqa: BLE001 - any compile failure
        return make(False)
    return compiled


BENCHMARK = benchmark("fused_linear_grpo", onca, reference, liger, uses_ref=False,
                      config="dapo, epsilon 0.2/0.2, beta 0 (no reference), old log-probs given; liger's "
                             "chunks uncompiled where its torch.compile fails")
