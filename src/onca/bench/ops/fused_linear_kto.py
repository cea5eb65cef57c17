"""Fused linear KTO benchmark: beta 0.1, a reference model of the policy's size, the batch's KL
estimate given (0), half the sequences desirable."""

from __future__ import annotations

import torch

from onca.bench.ops._posttrain import benchmark, token_logps

BETA = 0.1


def onca(p, inputs):
    from onca.ops.fused_linear_kto import fused_linear_kto

    i = inputs
    return lambda: fused_linear_kto(i["hidden"], i["weight"], i["labels"], i["desirable"], i["ref_hidden"],
                                    i["ref_weight"], kl=0.0, beta=BETA)


def reference(p, inputs):
    def eager(h, w, rh, rw, labels, desirable):
        with torch.no_grad():
            ref = token_logps(rh, rw, labels).sum(-1)
        rewards = token_logps(h, w, labels).sum(-1) - ref
        losses = torch.where(desirable, 1 - torch.sigmoid(BETA * rewards), 1 - torch.sigmoid(-BETA * rewards))
        return losses.mean()

    i = inputs
    return lambda: eager(i["hidden"], i["weight"], i["ref_hidden"], i["ref_weight"], i["labels"], i["desirable"])


def liger(p, inputs):
    from liger_kernel.chunked_loss import LigerFusedLinearKTOLoss

    loss = LigerFusedLinearKTOLoss(beta=BETA, use_ref_model=True)
    i = inputs
    kl = torch.zeros((), device=i["hidden"].device)
    return lambda: loss(i["hidden"], i["weight"], i["labels"], preference_labels=i["desirable"],
                        ref_input=i["ref_hidden"], ref_weight=i["ref_weight"], kl=kl)[0]


BENCHMARK = benchmark("fused_linear_kto", onca, reference, liger, uses_ref=True,
                      config=f"beta={BETA}, KL estimate 0, reference model of the policy's size")
