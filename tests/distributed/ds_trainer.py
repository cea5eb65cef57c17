"""Run under ``torchrun --nproc_per_node 2`` by ``test_deepspeed.py``: the Hugging Face Trainer with a
DeepSpeed ZeRO-3 config (through Accelerate), the same tiny model, weights and batches with and
without ``onca.apply``; rank 0 prints one JSON line of each variant's losses per step."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

ZERO3 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    # Partition every parameter, however small (the default keeps small ones whole on every rank).
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "bf16": {"enabled": False},
}


def train(model_type: str, patched: bool, gpus: bool) -> list[float]:
    import transformers

    import onca
    from onca.integrations.transformers import presets

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2, logging_steps=1,
            report_to=[], deepspeed=ZERO3, use_cpu=not gpus, save_strategy="no",
            ddp_backend=None if gpus else "gloo", seed=0)
        torch.manual_seed(0)
        config = presets.tiny_config(model_type, hidden_size=32, layers=2, vocab_size=96, heads=2, kv_heads=1)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if patched:
            onca.apply(model)
        g = torch.Generator().manual_seed(0)
        data = [{"input_ids": x, "labels": x} for x in torch.randint(3, 96, (12, 12), generator=g)]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        assert trainer.is_deepspeed_enabled, "the Trainer did not take the DeepSpeed config"
        trainer.train()
        stage = trainer.deepspeed.zero_optimization_stage()
        assert stage == 3, f"ZeRO stage {stage}"
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    gpus = torch.cuda.is_available()
    result = {}
    for model_type in sys.argv[1:]:
        result[model_type] = {"huggingface": train(model_type, False, gpus), "onca": train(model_type, True, gpus)}
    if int(os.environ.get("RANK", "0")) == 0:
        print("ONCA-RESULT " + json.dumps(result), flush=True)
