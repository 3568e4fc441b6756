"""The Hugging Face Trainer's own SP training loop under seqpar's step property (check_step):
`Trainer.train()` for one optimizer step with accelerate's ParallelismConfig(sp_backend=
"deepspeed") — the path the ALST docs give (accelerate wraps the model's attention with
DeepSpeed's UlyssesSPAttentionHF, the Trainer's dataloader with UlyssesSPDataLoaderAdapter, and
computes the loss with transformers' deepspeed_sp_compute_loss; a DeepSpeed engine, float32,
ZeRO 0, SGD at learning rate 0) — on CPU gloo ranks:

    python3 -m seqpar.testing check-step "python/examples/trainer_step.py:make_step()" \\
        --hf-config tests/python/data/hf_configs/qwen3-8b.json --attn seqpar_varlen \\
        --max-dp 1 --max-ring 1 --ulysses 2,4 --no-accumulation --dtypes f32 --seed 0

How the global batch reaches the loop: every SP rank's dataset is the micro-batch's rows (padded
to a multiple of the SP degree, as the Trainer's collator does with pad_to_multiple_of). The
adapter all-gathers one batch per SP rank and yields each of them, sequence-sharded, in turn —
U sub-batches per gathered set — so the step runs with gradient_accumulation_steps = U: one
optimizer step over U copies of the micro-batch, whose mean is the micro-batch's own loss and
gradient (the weights are the same for every copy).

What is ours: the kernel under DeepSpeed's wrapper — seqpar.testing.hf's varlen attention
registered as "flash_attention_2" (accelerate accepts only flash-attention or sdpa as the SP core,
and sdpa gets no document mask from the wrapper: packed documents would attend across their
boundaries), and the read of the gradients: taken inside accelerate's DeepSpeedEngineWrapper at
the last micro-step, after the engine's backward and before its step (which zeroes them).
float32 only: DeepSpeed reduces no float64 gradient.
"""
import os
import tempfile

import torch

IGNORE = -100
_CORE = {}


def _pad_to_multiple(rows, m, pad_id=0):
    L = rows["input_ids"].shape[1]
    extra = -L % m
    if not extra:
        return rows
    B = rows["input_ids"].shape[0]
    pad = {"input_ids": torch.full((B, extra), pad_id, dtype=torch.long),
           "labels": torch.full((B, extra), IGNORE, dtype=torch.long),
           "position_ids": torch.arange(extra).repeat(B, 1)}
    return {k: torch.cat([v, pad[k]], dim=1) for k, v in rows.items()}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return self.rows["input_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.rows.items()}


def _collate(items):
    return {k: torch.stack([x[k] for x in items]) for k in items[0]}


def make_step():
    """The per-rank step: one `Trainer.train()` optimizer step (see the module's text); returns
    the loss the Trainer reports (TrainOutput.training_loss)."""

    # Imported here, in the process that calls make_step (seqpar.testing's own, which forks the
    # ranks), so that every rank inherits them: imported inside step(), each rank of each pool
    # paid for them again (accelerate's, DeepSpeed's and transformers' seconds of CPU).
    import accelerate.utils.deepspeed as acd
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers import Trainer, TrainingArguments
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from seqpar.testing.hf import varlen_attention

    def step(model, batches, ctx):
        if ctx.dp_size != 1 or len(batches) != 1 or ctx.dtype != torch.float32:
            raise ValueError("trainer_step: one DP replica, one micro-batch, float32 (run with "
                             "--max-dp 1 --no-accumulation --dtypes f32)")
        os.environ.update(LOCAL_RANK=str(ctx.rank), RANK=str(ctx.rank),
                          WORLD_SIZE=str(ctx.world_size), LOCAL_WORLD_SIZE=str(ctx.world_size),
                          CUDA_VISIBLE_DEVICES="")
        # Every Trainer registers DeepSpeed's wrapper around the core: the core back first
        ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = varlen_attention
        parallel_state_sp._release_sequence_parallel_groups()
        AcceleratorState._reset_state(True)
        model.config._attn_implementation = "flash_attention_2"
        rows = _pad_to_multiple(dict(batches[0]), ctx.sp_size)
        B = rows["input_ids"].shape[0]
        grads = {}

        def backward(self, loss, sync_gradients=True, **kw):   # accelerate's, read in between
            self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
            self.engine.backward(loss, **kw)
            if sync_gradients:
                for n, p in self.engine.module.named_parameters():
                    if p.grad is not None:
                        grads[n] = p.grad.detach().clone()
                self.engine.step()
        original = acd.DeepSpeedEngineWrapper.backward
        acd.DeepSpeedEngineWrapper.backward = backward
        try:
            with tempfile.TemporaryDirectory() as out:
                args = TrainingArguments(
                    output_dir=out, per_device_train_batch_size=B, max_steps=1,
                    gradient_accumulation_steps=ctx.sp_size, learning_rate=0.0,
                    report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                    dataloader_drop_last=False,
                    deepspeed={"train_micro_batch_size_per_gpu": B,
                               "gradient_accumulation_steps": ctx.sp_size,
                               "zero_optimization": {"stage": 0},
                               "zero_allow_untested_optimizer": True,
                               "optimizer": {"type": "SGD", "params": {"lr": 0.0}}},
                    parallelism_config=ParallelismConfig(
                        sp_backend="deepspeed", sp_size=ctx.sp_size,
                        sp_handler=DeepSpeedSequenceParallelConfig(
                            sp_seq_length_is_variable=True,
                            sp_attn_implementation="flash_attention_2")))
                trainer = Trainer(model=model, args=args, train_dataset=_Rows(rows),
                                  data_collator=_collate)
                result = trainer.train()
        finally:
            acd.DeepSpeedEngineWrapper.backward = original
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        return float(result.training_loss)

    step.__name__ = "trainer_step"
    return step
