"""Fused linear distillation benchmark: forward KL from a teacher head of the student's size over
the same tokens (the ``ref_hidden``/``ref_weight`` inputs), temperature 1, no hard-label term."""

from __future__ import annotations

import torch

from onca.bench.ops._posttrain import benchmark


def onca(p, inputs):
    from onca.ops.fused_linear_distill import fused_linear_distill

    i = inputs
    return lambda: fused_linear_distill(i["hidden"], i["weight"], i["ref_hidden"], i["ref_weight"], i["labels"])


def reference(p, inputs):
    def eager(h, w, th, tw, labels):
        log_q = torch.log_softmax((h @ w.T).float(), -1)
        with torch.no_grad():
            log_p = torch.log_softmax((th @ tw.T).float(), -1)
        valid = labels != -100
        per = (log_p.exp() * (log_p - log_q)).sum(-1)
        return (per * valid).sum() / valid.sum().clamp(min=1)

    i = inputs
    return lambda: eager(i["hidden"], i["weight"], i["ref_hidden"], i["ref_weight"], i["labels"])


def liger(p, inputs):
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    # liger's distillation loss is the generalised JSD: beta 0 is the forward KL.
    loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0)
    i = inputs
    h, th = (i[k].reshape(-1, i[k].shape[-1]) for k in ("hidden", "ref_hidden"))
    return lambda: loss(h, i["weight"], th, i["ref_weight"], i["labels"].reshape(-1))


BENCHMARK = benchmark("fused_linear_distill", onca, reference, liger, uses_ref=True,
                      config="forward KL, temperature 1, teacher head of the student's size")
