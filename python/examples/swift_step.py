"""ms-swift's sequence-parallel training step under seqpar's step property (check_step): ms-swift's
own SP code — its SequenceParallel (the dp × sequence device mesh, the pre-forward hook that pads
and splits input_ids and position_ids, prepare_inputs, which pads, pre-shifts (torch.roll) and
splits the labels, the Ulysses all-to-alls of its DistributedAttention around the kernel), its
per-token SP loss (per_token_loss_func_sp: the cross-entropy of the shard, gathered to the full
sequence by GatherLoss, whose backward multiplies by the SP degree) and its trainer's loss
(swift.trainers.Seq2SeqTrainer.compute_loss, run as it is; with check_step's loss_weights, its
loss_scale: padded, shifted and split with the labels, gathered and applied to the token
losses), with the loss denominator from transformers' Trainer._get_num_items_in_batch (run as
it is) — on CPU gloo ranks:

    python3 -m seqpar.testing check-step "python/examples/swift_step.py:make_step()" \\
        --hf-config tests/python/data/hf_configs/qwen3-8b.json --attn seqpar_varlen \\
        --max-ring 1 --ulysses 2 --dtypes f64,f32 --seed 0

What is ours, because it cannot run on a CPU or is the trainer's loop around the calls:
- the kernel under ms-swift's Ulysses wrapper: flash_attention_2's contract on the CPU
  (seqpar.testing.hf's varlen attention, the packed documents from the gathered position_ids)
  in place of transformers' flash-attn forward, which ms-swift's wrapper calls;
- the padding-free collation: each micro-batch's rows concatenated into one packed row (ms-swift
  packs samples so with padding_free; a row's padding stays as a document of its own, whose
  labels are all -100);
- the loop of transformers' Trainer.training_step around compute_loss (the loss divided by the
  accumulation steps where the model takes no loss kwargs, then backward), DDP's averaging of
  the gradients over every rank (ms-swift trains SP ranks as DDP ranks: GatherLoss's ×SP
  compensates), and the logged loss (every micro-batch's loss summed, averaged over the ranks,
  as the Trainer's nested_gather(tr_loss).mean()).

Ring attention is not run: ms-swift takes sp = gcd(KV heads, SP degree) for Ulysses and puts
the rest on a zigzag ring whose kernel needs flash-attn or an NPU; the example refuses degrees
that do not divide the KV heads.

Two settings a user can have, each a keyword:
  average_tokens_across_devices=False   transformers' TrainingArguments flag: the loss's
        denominator is each replica's own label count (every replica's mean averaged by DDP)
  model_accepts_loss_kwargs=False       the template's flag (ms-swift's Qwen3-TTS template sets
        it): transformers passes no num_items_in_batch, and ms-swift's compute_loss counts the
        shard's labels and all-reduces the count over the default (world) group
"""
import copy
import math
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

IGNORE = -100
_STATE = {}   # per process: the topology ms-swift's mesh was built for


def _mesh(sp, model, ctx):
    """ms-swift's SequenceParallel for this example's dp × Ulysses, its device mesh rebuilt when
    the topology changes (the singleton builds it once, at the first prepare)."""
    kv = model.config.num_key_value_heads or model.config.num_attention_heads
    if math.gcd(kv, ctx.sp_size) != ctx.sp_size or ctx.ring != 1:
        raise ValueError(
            "swift_step: ms-swift runs Ulysses over gcd(KV heads %d, SP degree %d) ranks and a "
            "ring over the rest, and its ring needs flash-attn (a GPU); draw Ulysses degrees "
            "that divide the KV heads and no ring (--ulysses, --max-ring 1)" % (kv, ctx.sp_size))
    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank),
                      WORLD_SIZE=str(ctx.world_size), LOCAL_WORLD_SIZE=str(ctx.world_size))
    key = (ctx.world_size, ctx.dp_size, ctx.sp_size, kv)
    if _STATE.get("topology") != key and type(sp)._global_inited:
        sp.world_size, sp.num_heads = ctx.sp_size, kv
        sp._init_device_mesh()
    _STATE["topology"] = key


def _swift_model(model, ctx):
    """A copy of `model` prepared by ms-swift's SequenceParallel (its hooks and patches stay on
    the copy; the model seqpar gave keeps none)."""
    from swift.sequence_parallel import sequence_parallel as sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from seqpar.testing.hf import varlen_attention
    _mesh(sp, model, ctx)
    sm = copy.deepcopy(model)
    sm.model_meta = SimpleNamespace(model_arch=None)   # swift.model.get_llm_model: sm.model
    cfg = model.config
    sm.model_info = SimpleNamespace(is_moe_model=bool(
        getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0)))
    sp.prepare(ctx.sp_size, model=sm, tokenizer=SimpleNamespace(pad_token_id=0),
               padding_free=True)
    if sp.sp_rank != ctx.sp_rank or sp.dp_rank != ctx.dp_rank:
        raise RuntimeError("ms-swift's mesh puts world rank %d at SP rank %d, DP rank %d; "
                           "seqpar at %d, %d" % (ctx.rank, sp.sp_rank, sp.dp_rank, ctx.sp_rank,
                                                 ctx.dp_rank))
    # ms-swift's wrapper calls transformers' flash-attn forward after its all-to-all: the CPU
    # kernel with that contract in its place
    ALL_ATTENTION_FUNCTIONS["flash_attention_2_origin"] = varlen_attention
    sm.config._attn_implementation = "flash_attention_2"
    sm.zero_grad(set_to_none=True)
    return sp, sm


def _packed(batch, dtype):
    """A micro-batch's rows as one packed row (padding-free collation); per-token loss weights
    as ms-swift's loss_scale (aligned with the labels, as its templates make it)."""
    out = {k: batch[k].reshape(1, -1).clone() for k in ("input_ids", "labels", "position_ids")}
    if "loss_weights" in batch:
        out["loss_scale"] = batch["loss_weights"].reshape(1, -1).to(dtype)
    return out


def _trainer(ctx, average_tokens, accepts_loss_kwargs, model):
    """The attributes of ms-swift's Seq2SeqTrainer (and transformers' Trainer) that compute_loss
    and _get_num_items_in_batch read, for an SFT run without liger, DFT, channel loss, loss
    scale or label smoothing."""

    def gather(t):   # accelerate's gather of a scalar: one value per process
        out = [torch.zeros_like(t.reshape(1)) for _ in range(ctx.world_size)]
        dist.all_gather(out, t.reshape(1).contiguous(), group=ctx.world_group)
        return torch.cat(out)

    def compute_sft_loss(model, inputs, num_items_in_batch=None, trainer=None):
        from swift.template import Template
        return Template.compute_sft_loss(None, model, inputs, num_items_in_batch, trainer)

    return SimpleNamespace(
        label_smoother=None, compute_loss_func=None,
        model_accepts_loss_kwargs=accepts_loss_kwargs, model=model,
        args=SimpleNamespace(use_liger_kernel=False, enable_dft_loss=False,
                             enable_channel_loss=False, average_tokens_across_devices=average_tokens,
                             world_size=ctx.world_size, n_gpu=0, past_index=-1,
                             router_aux_loss_coef=None, tuner_backend="peft", acc_strategy="token"),
        template=SimpleNamespace(sequence_parallel_size=ctx.sp_size, padding_free=True,
                                 compute_sft_loss=compute_sft_loss),
        accelerator=SimpleNamespace(num_processes=ctx.world_size, gather=gather,
                                    unwrap_model=lambda m: m),
        custom_metrics={"train": {}, "eval": {}},
        _compute_acc=lambda *a, **k: None)   # token accuracy: a metric, not the loss


def make_step(average_tokens_across_devices=True, model_accepts_loss_kwargs=True):
    """The per-rank step, as ms-swift's Seq2SeqTrainer runs one optimizer step: the step's label
    count (transformers' _get_num_items_in_batch over the micro-batches), per micro-batch
    ms-swift's _prepare_inputs (SequenceParallel.prepare_inputs), compute_loss and backward;
    then DDP's averaging of the gradients and the logged loss."""

    # Imported here, in the process that calls make_step (seqpar.testing's own, which forks the
    # ranks), so that every rank inherits them: imported inside step(), each rank of each pool
    # paid for them again (ms-swift's and transformers' ~5 s of CPU).
    import swift.sequence_parallel  # noqa: F401
    import swift.template  # noqa: F401
    from swift.trainers import Seq2SeqTrainer
    from transformers import Trainer
    import transformers.modeling_utils  # noqa: F401

    def step(model, batches, ctx):
        sp, sm = _swift_model(model, ctx)
        tr = _trainer(ctx, average_tokens_across_devices,
                      model_accepts_loss_kwargs, sm)
        micro = [_packed(b, ctx.dtype) for b in batches]
        n_items = Trainer._get_num_items_in_batch(tr, micro, torch.device("cpu"))
        logged = 0.0
        for mb in micro:
            inputs = dict(mb)
            sp.prepare_inputs(inputs)   # ms-swift's _prepare_inputs under SP
            loss = Seq2SeqTrainer.compute_loss(tr, sm, inputs, num_items_in_batch=n_items)
            if not model_accepts_loss_kwargs or n_items is None:   # Trainer.training_step
                loss = loss / len(micro)
            loss.backward()
            logged += float(loss.detach())
        # DDP's averaging over every rank, and the Trainer's logged loss
        params = dict(model.named_parameters())
        for name, p in sm.named_parameters():
            g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            dist.all_reduce(g, group=ctx.world_group)
            params[name].grad = g / ctx.world_size
        total = torch.tensor(logged, dtype=torch.float64)
        dist.all_reduce(total, group=ctx.world_group)
        return float(total) / ctx.world_size

    flags = [k for k, v in (("average_tokens_across_devices=False", average_tokens_across_devices),
                            ("model_accepts_loss_kwargs=False", model_accepts_loss_kwargs)) if not v]
    step.__name__ = "swift_step(%s)" % (", ".join(flags) or "sft")
    return step
