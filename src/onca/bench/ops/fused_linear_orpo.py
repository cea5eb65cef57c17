"""Fused linear ORPO benchmark: beta 0.1, the chosen NLL term, no reference model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onca.bench.ops._posttrain import benchmark, token_logps

BETA = 0.1


def onca(p, inputs):
    from onca.ops.fused_linear_orpo import fused_linear_orpo

    i = inputs
    return lambda: fused_linear_orpo(i["hidden"], i["weight"], i["labels"], beta=BETA)


def reference(p, inputs):
    def eager(h, w, labels):
        mask = labels != -100
        per = token_logps(h, w, labels)
        avg = per.sum(-1) / mask.sum(-1).clamp(min=1)
        n = avg.shape[0] // 2
        c, r = avg[:n], avg[n:]
        log_odds = (c - r) - (torch.log1p(-c.exp()) - torch.log1p(-r.exp()))
        nll = -per[:n].sum() / mask[:n].sum().clamp(min=1)
        return nll - BETA * F.logsigmoid(log_odds).mean()

    i = inputs
    return lambda: eager(i["hidden"], i["weight"], i["labels"])


def liger(p, inputs):
    from liger_kernel.chunked_loss import LigerFusedLinearORPOLoss

    loss = LigerFusedLinearORPOLoss(beta=BETA)
    i = inputs
    return lambda: loss(i["weight"], i["hidden"], i["labels"])[0]


BENCHMARK = benchmark("fused_linear_orpo", onca, reference, liger, uses_ref=False,
                      config=f"beta={BETA}, chosen NLL term")
