"""TRL's SFT, DPO and GRPO trainers on a tiny Qwen3 (CPU), with Onca applied before the trainer
is built and after it (on ``trainer.model``, over TRL's fused-LM-head wrapper): both train with
the plain model's losses and gradient norms. With ``onca.integrations.trl`` enabled, TRL's fused
LM head runs on Onca's ops (counted) and the trainers still train with the plain model's losses,
gradient norms and logged metrics."""

from __future__ import annotations

import pytest
import torch

import onca
import onca.integrations.trl as onca_trl
from onca.integrations.transformers import forwards
from onca.integrations.transformers.presets import tiny_config
from onca.ops import _chunked_head

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

STEPS = 2


def _tokenizer():
    """A character-level tokenizer built here: the trainers need one, and the tests no network."""
    chars = [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *chars])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3", vocab_size=128))


def _common(tmp_path):
    # fp32 (TRL's configs default to bf16 autocast): the runs must then agree to fp32's precision.
    # On the accelerator where there is one: Onca's kernels run on its tensors (the interpreter, on
    # the CPU, only where there is none).
    return dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1,
                report_to="none", use_cpu=onca.device.accelerator() == "cpu", save_strategy="no", learning_rate=1e-3, seed=0,
                dataloader_num_workers=0, bf16=False)


def _sft(model, tmp_path):
    data = datasets.Dataset.from_dict({"text": ["hello world", "onca kernels", "abc def", "xyz"]})
    return trl.SFTTrainer(model=model, args=trl.SFTConfig(max_length=16, **_common(tmp_path)),
                          train_dataset=data, processing_class=_tokenizer())


def _dpo(model, tmp_path):
    data = datasets.Dataset.from_dict({"prompt": ["hi ", "2+2="] * 2, "chosen": ["there", "4"] * 2,
                                       "rejected": ["no", "5"] * 2})
    args = trl.DPOConfig(max_length=16, **_common(tmp_path))
    return trl.DPOTrainer(model=model, ref_model=_model(), args=args, train_dataset=data,
                          processing_class=_tokenizer())


def _reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _grpo(model, tmp_path):
    data = datasets.Dataset.from_dict({"prompt": ["hi ", "2+2=", "ab", "cd"]})
    args = trl.GRPOConfig(max_completion_length=4, num_generations=2, **_common(tmp_path))
    return trl.GRPOTrainer(model=model, reward_funcs=_reward_length, args=args, train_dataset=data,
                           processing_class=_tokenizer())


TRAINERS = {"sft": _sft, "dpo": _dpo, "grpo": _grpo}


# Metrics the trainers log from the fused head's extra outputs (entropy, top-1 flags, mean logits).
METRICS = ("entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected")


def _train(trainer):
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == STEPS
    return [(h["loss"], h["grad_norm"], *(h[m] for m in METRICS if m in h)) for h in logs]


_PLAIN: dict[str, list] = {}


def _plain(trainer_name, tmp_path):
    """The plain model's run (once per trainer for the module: both tests compare with it)."""
    if trainer_name not in _PLAIN:
        _PLAIN[trainer_name] = _train(TRAINERS[trainer_name](_model(), tmp_path))
        assert any(row[1] > 0 for row in _PLAIN[trainer_name])  # the comparisons compare something
    return _PLAIN[trainer_name]


@pytest.mark.parametrize("trainer_name", TRAINERS)
def test_trainer_with_onca_before_and_after_matches_the_plain_model(trainer_name, tmp_path):
    build = TRAINERS[trainer_name]
    plain = _plain(trainer_name, tmp_path)

    before = build(onca.apply(_model()), tmp_path)
    # TRL wrapped Onca's forward: its fused LM head runs on the Onca-patched backbone.
    assert forwards.onca_kind(before.model.forward) is None
    losses_before = _train(before)
    onca.unapply(before.model)

    after = build(_model(), tmp_path)
    trl_forward = after.model.forward
    onca.unapply(onca.apply(after.model))
    assert after.model.forward is trl_forward
    onca.apply(after.model)
    assert forwards.onca_kind(after.model.forward) == "fused_linear_cross_entropy"
    losses_after = _train(after)

    for onca_run in (losses_before, losses_after):
        torch.testing.assert_close(torch.tensor(onca_run), torch.tensor(plain), rtol=1e-4, atol=1e-5)


def _counting(monkeypatch, op, counts, key):
    fn = op.fn

    def counted(*args):
        counts[key] += 1
        return fn(*args)

    monkeypatch.setattr(op, "fn", counted)


@pytest.mark.parametrize("trainer_name, keep_logits", [(name, False) for name in TRAINERS] + [("grpo", True)],
                         ids=lambda v: {True: "kept-logits", False: "recomputed"}.get(v, v))
def test_trainer_with_onca_fused_lm_head_matches_the_plain_model(trainer_name, keep_logits, tmp_path,
                                                                 monkeypatch):
    """``onca.integrations.trl.enabled()`` with ``onca.apply``: TRL's fused head computes through
    Onca's ops (forward and backward counted), and the run is the plain model's; with
    ``keep_logits=True`` too, every forward asked to keep them."""
    counts = {"forward": 0, "backward": 0}
    _counting(monkeypatch, _chunked_head.chunked_logprob_forward, counts, "forward")
    _counting(monkeypatch, _chunked_head.chunked_logprob_backward, counts, "backward")
    kept = []
    forward_fn = _chunked_head.chunked_logprob_forward.fn
    monkeypatch.setattr(_chunked_head.chunked_logprob_forward, "fn",
                        lambda *args: kept.append(args[-1]) or forward_fn(*args))
    plain = _plain(trainer_name, tmp_path)
    assert counts == {"forward": 0, "backward": 0}  # TRL's own kernel ran there
    before = onca_trl.calls()
    with onca_trl.enabled(keep_logits=keep_logits):
        assert onca_trl.is_enabled()
        run = _train(TRAINERS[trainer_name](onca.apply(_model()), tmp_path))
    assert not onca_trl.is_enabled()
    assert kept and set(kept) == {keep_logits}
    assert counts["forward"] >= STEPS and counts["backward"] >= STEPS
    after = onca_trl.calls()
    assert after["forward"] - before["forward"] == counts["forward"]
    assert after["backward"] - before["backward"] == counts["backward"]
    assert len(plain[0]) > 2, plain  # a metric from the head's extra outputs is compared too
    torch.testing.assert_close(torch.tensor(run), torch.tensor(plain), rtol=1e-4, atol=1e-5)


def test_enable_is_idempotent_and_disable_restores_trl():
    import trl.kernels
    from trl.trainer import utils

    original = utils._ChunkedLogProbFunction
    onca_trl.enable()
    onca_trl.enable()
    assert utils._ChunkedLogProbFunction is onca_trl.ChunkedLogProbFunction
    assert trl.kernels.ChunkedLogProbFunction is onca_trl.ChunkedLogProbFunction
    onca_trl.disable()
    assert utils._ChunkedLogProbFunction is original and trl.kernels.ChunkedLogProbFunction is original
    assert not onca_trl.is_enabled()


def test_enabled_restores_the_earlier_keep_logits():
    onca_trl.enable(keep_logits=True)
    try:
        with onca_trl.enabled():
            assert onca_trl._KEEP_LOGITS[0] is False
        assert onca_trl.is_enabled() and onca_trl._KEEP_LOGITS[0] is True
    finally:
        onca_trl.disable()
    assert onca_trl._KEEP_LOGITS[0] is False
    with pytest.raises(TypeError, match="keep_logits"):
        onca_trl.enable(keep_logits="yes")
    assert not onca_trl.is_enabled()
