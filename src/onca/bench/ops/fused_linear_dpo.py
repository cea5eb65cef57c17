"""Fused linear DPO benchmark: sigmoid loss, beta 0.1, a reference model of the policy's size."""

from __future__ import annotations

import torch.nn.functional as F

from onca.bench.ops._posttrain import benchmark, token_logps

BETA = 0.1


def onca(p, inputs):
    from onca.ops.fused_linear_dpo import fused_linear_dpo

    i = inputs
    return lambda: fused_linear_dpo(i["hidden"], i["weight"], i["labels"], i["ref_hidden"], i["ref_weight"], beta=BETA)


def reference(p, inputs):
    import torch

    def eager(h, w, rh, rw, labels):
        pi = token_logps(h, w, labels).sum(-1)
        with torch.no_grad():
            ref = token_logps(rh, rw, labels).sum(-1)
        n = pi.shape[0] // 2
        return -F.logsigmoid(BETA * ((pi[:n] - ref[:n]) - (pi[n:] - ref[n:]))).mean()

    i = inputs
    return lambda: eager(i["hidden"], i["weight"], i["ref_hidden"], i["ref_weight"], i["labels"])


def liger(p, inputs):
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    loss = LigerFusedLinearDPOLoss(beta=BETA, use_ref_model=True)
    i = inputs
    return lambda: loss(i["weight"], i["hidden"], i["labels"], ref_input=i["ref_hidden"],
                        ref_weight=i["ref_weight"])[0]


BENCHMARK = benchmark("fused_linear_dpo", onca, reference, liger, uses_ref=True,
                      config=f"sigmoid, beta={BETA}, reference model of the policy's size")
