"""Fused linear CPO benchmark: sigmoid loss, beta 0.1, the chosen NLL term, no reference model."""

from __future__ import annotations

import torch.nn.functional as F

from onca.bench.ops._posttrain import benchmark, token_logps

BETA = 0.1


def onca(p, inputs):
    from onca.ops.fused_linear_cpo import fused_linear_cpo

    i = inputs
    return lambda: fused_linear_cpo(i["hidden"], i["weight"], i["labels"], beta=BETA)


def reference(p, inputs):
    def eager(h, w, labels):
        mask = labels != -100
        per = token_logps(h, w, labels)
        total = per.sum(-1)
        n = total.shape[0] // 2
        nll = -per[:n].sum() / mask[:n].sum().clamp(min=1)
        return -F.logsigmoid(BETA * (total[:n] - total[n:])).mean() + nll

    i = inputs
    return lambda: eager(i["hidden"], i["weight"], i["labels"])


def liger(p, inputs):
    from liger_kernel.chunked_loss import LigerFusedLinearCPOLoss

    loss = LigerFusedLinearCPOLoss(beta=BETA)
    i = inputs
    return lambda: loss(i["weight"], i["hidden"], i["labels"])[0]


BENCHMARK = benchmark("fused_linear_cpo", onca, reference, liger, uses_ref=False,
                      config=f"sigmoid, beta={BETA}, chosen NLL term")
