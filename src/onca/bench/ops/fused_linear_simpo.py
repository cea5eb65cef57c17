"""Fused linear SimPO benchmark: beta 2, gamma 0.5, no reference model."""

from __future__ import annotations

import torch.nn.functional as F

from onca.bench.ops._posttrain import benchmark, token_logps

BETA, GAMMA = 2.0, 0.5


def onca(p, inputs):
    from onca.ops.fused_linear_simpo import fused_linear_simpo

    i = inputs
    return lambda: fused_linear_simpo(i["hidden"], i["weight"], i["labels"], beta=BETA, gamma=GAMMA)


def reference(p, inputs):
    def eager(h, w, labels):
        avg = token_logps(h, w, labels).sum(-1) / (labels != -100).sum(-1).clamp(min=1)
        n = avg.shape[0] // 2
        return -F.logsigmoid(BETA * (avg[:n] - avg[n:]) - GAMMA).mean()

    i = inputs
    return lambda: eager(i["hidden"], i["weight"], i["labels"])


def liger(p, inputs):
    from liger_kernel.chunked_loss import LigerFusedLinearSimPOLoss

    loss = LigerFusedLinearSimPOLoss(beta=BETA, gamma=GAMMA, alpha=0.0, compute_nll_loss=False)
    i = inputs
    return lambda: loss(i["weight"], i["hidden"], i["labels"])[0]


BENCHMARK = benchmark("fused_linear_simpo", onca, reference, liger, uses_ref=False,
                      config=f"beta={BETA}, gamma={GAMMA}, no NLL term")
