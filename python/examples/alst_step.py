"""DeepSpeed ALST's whole Hugging Face path under seqpar's step property (check_step): a small
Qwen3 (or any transformers config) whose attention DeepSpeed's UlyssesSPAttentionHF wraps, the
global batch sharded by DeepSpeed's UlyssesSPDataLoaderAdapter (shift_labels made before the
cut), the loss aggregated over the SP group by transformers' own Trainer code
(transformers.integrations.deepspeed.deepspeed_sp_compute_loss) and the gradients reduced by a
DeepSpeed engine (float32, ZeRO stage 0 or 1; DeepSpeed reduces no float64 gradient, so in
float64 the step reduces them as the engine's ZeRO-0 path does) — every piece the frameworks'
code, run on CPU gloo ranks:

    python3 -m seqpar.testing check-step "python/examples/alst_step.py:make_step()" \
        --hf-config tests/python/data/hf_configs/qwen3-8b.json --attn seqpar_varlen \
        --max-dp 1 --max-ring 1 --ulysses 2,4 --no-accumulation --dtypes f64,f32 --seed 0

fails (DeepSpeed 0.19.8, transformers 5.9.0): every gradient is the SP degree times the loss's.
make_step(fixed=True) applies the two workarounds (docs/testing.md, "DeepSpeed ALST's whole
path") and passes.

What is ours: the collator's padding of each row to a multiple of the SP size (the adapter
refuses other lengths; the Trainer pads with pad_to_multiple_of), the core attention under
Ulysses — seqpar_varlen, flash_attention_2's contract on the CPU (documents from position_ids,
no mask tensor) — and the model's loss function: transformers' ForCausalLMLoss without its
float32 upcast (which would hide float64 agreement), same reduction, same shift_labels handling.

The step's classic mistakes, each one keyword away (make_step(mistake, fixed=True)):
  'tutorial'      the aggregation as the SP tutorials print it (accelerate's concept guide,
                  DeepSpeed's ALST tutorial): a shard without a valid label has a NaN mean,
                  and NaN · 0 poisons the sum
  'local_mean'    each rank's own mean logged and backpropagated (no aggregation): the
                  denominator local where it must be the SP group's
  'shift_after'   labels shifted after the adapter's cut (each rank shifts its own shard): every
                  shard's last token loses its target
"""
import os

import torch
import torch.distributed as dist

IGNORE = -100

_REGISTERED = {}   # per process: the core attention and DeepSpeed's parallel state, per SP size


def _f64_causal_lm_loss(logits, labels=None, vocab_size=None, num_items_in_batch=None,
                        ignore_index=IGNORE, shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss in the logits' own dtype (it upcasts to float32): the
    shift when no shift_labels are given, then transformers' fixed_cross_entropy."""
    from transformers.loss.loss_utils import fixed_cross_entropy
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.reshape(-1, vocab_size)
    return fixed_cross_entropy(logits, shift_labels.reshape(-1).to(logits.device),
                               num_items_in_batch, ignore_index, **kwargs)


def _register(model, ctx, micro_batch_size):
    """UlyssesSPAttentionHF.register_with_transformers, once per process, SP size and micro-batch
    size (the wrapper checks every shape against it): it wraps the core attention in
    transformers' registry and makes DeepSpeed's SP groups (consecutive world ranks, as
    seqpar's sp_group). A second registration would wrap the wrapper, so the core is put back
    (and the groups released) before another registers."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    name = model.config._attn_implementation
    key = (name, ctx.sp_size, micro_batch_size)
    if key in _REGISTERED:
        return _REGISTERED[key]
    core = _REGISTERED.setdefault(("core", name), ALL_ATTENTION_FUNCTIONS[name])
    ALL_ATTENTION_FUNCTIONS[name] = core
    parallel_state_sp._release_sequence_parallel_groups()
    for k in [k for k in _REGISTERED if k[0] == name]:
        del _REGISTERED[k]
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=name,
        sequence_parallel_size=ctx.sp_size, micro_batch_size=micro_batch_size,
        seq_length_is_variable=True)
    _REGISTERED[key] = mpu
    return mpu


def _pad_to_multiple(batch, m, pad_id=0):
    """The collator's pad_to_multiple_of: tokens pad_id, labels -100, position_ids a run of
    their own from 0."""
    L = batch["input_ids"].shape[1]
    extra = -L % m
    if not extra:
        return dict(batch)
    B = batch["input_ids"].shape[0]
    pad = {"input_ids": torch.full((B, extra), pad_id, dtype=torch.long),
           "labels": torch.full((B, extra), IGNORE, dtype=torch.long),
           "position_ids": torch.arange(extra).repeat(B, 1)}
    return {k: torch.cat([v, pad[k]], dim=1) for k, v in batch.items()}


def _gloo_all_gather_backward():
    """Workaround for torch's differentiable all_gather on gloo (torch 2.11.0): its backward
    emulates a reduce-scatter with dist.scatter(src=i, group=g), i being the rank in the group
    where scatter takes a global rank, so every group but the one holding global rank 0 raises.
    Here the backward is the reduce-scatter itself: every rank's gradients of the gathered
    parts summed over the group (all_reduce), this rank's part kept."""
    from torch.distributed.nn import functional as F
    if getattr(F._AllGather, "seqpar_gloo_fix", False):
        return
    torch_backward = F._AllGather.backward

    def backward(ctx, *grads):
        if dist.get_backend(group=ctx.group) != dist.Backend.GLOO:
            return torch_backward(ctx, *grads)
        g = torch.stack([x.contiguous() for x in grads])
        dist.all_reduce(g, group=ctx.group)
        return None, g[dist.get_rank(group=ctx.group)]
    F._AllGather.backward = staticmethod(backward)
    F._AllGather.seqpar_gloo_fix = True


class _Parallelism(object):
    """What deepspeed_sp_compute_loss reads of accelerate's ParallelismConfig."""

    def __init__(self, sp_size):
        self.sp_backend, self.sp_size, self.sp_enabled = "deepspeed", sp_size, sp_size > 1


def make_step(mistake=None, zero_stage=0, fixed=False):
    """The per-rank step: for every micro-batch, the adapter's shard, the model, the recipe's
    loss and the engine's backward (one engine micro-step each, gradient_accumulation_steps =
    the micro-batches); the gradients the engine leaves after the last one (ZeRO 1:
    DeepSpeed's safe_get_full_grad per parameter). Returns the mean of the logged losses.

    fixed: the workarounds for what seqpar finds in this path (docs/testing.md): the backward of
    the aggregated loss divided by the SP degree (every SP rank holds the same aggregated loss
    and the differentiable all_gather's backward sums their gradients: without it every
    gradient is SP-degree times the loss's); a zero loss that still reaches every parameter
    where no SP rank holds a valid label (deepspeed_sp_compute_loss then returns the Python
    number 0.0, which has no backward); on gloo, torch's all_gather given a backward that works
    for every SP group (_gloo_all_gather_backward)."""

    # Imported here, in the process that calls make_step (seqpar.testing's own, which forks the
    # ranks), so that every rank inherits them: imported inside step(), each rank of each pool
    # paid for them again (DeepSpeed's and transformers' ~4 s of CPU, and the Muon optimizer that
    # deepspeed.initialize imports on its first call, whose import probes DeepSpeed's ops by
    # compiling test programs).
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from deepspeed.utils import safe_get_full_grad
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:  # as deepspeed's own import of it
        pass

    def step(model, batches, ctx):
        model.loss_function = _f64_causal_lm_loss
        if fixed:
            _gloo_all_gather_backward()
        # what a launcher (torchrun, deepspeed) sets: every rank on this host
        os.environ.update(LOCAL_RANK=str(ctx.rank), RANK=str(ctx.rank),
                          WORLD_SIZE=str(ctx.world_size), LOCAL_WORLD_SIZE=str(ctx.world_size))
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        rows = [_pad_to_multiple(mb, ctx.sp_size) for mb in batches]
        B = rows[0]["input_ids"].shape[0]
        mpu = _register(model, ctx, B) if ctx.sp_size > 1 else None
        sp_group = mpu.get_sequence_parallel_group() if mpu else None
        if ctx.dtype == torch.float64:
            # DeepSpeed's engine reduces no float64 gradient ("unsupported grad type"): the
            # model runs bare and its gradients are reduced as the engine's ZeRO-0 path does
            # (summed over the SP × DP group, divided by the DP degree, 1/accumulation per
            # micro-step)
            engine = None
            from deepspeed.utils import groups
            groups.mpu = mpu
        else:
            config = {"train_micro_batch_size_per_gpu": B,
                      "gradient_accumulation_steps": len(rows),
                      "zero_optimization": {"stage": zero_stage},
                      "zero_allow_untested_optimizer": True,
                      "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
                      "sequence_parallel_size": ctx.sp_size}
            engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu,
                                                   model_parameters=model.parameters())
        run = engine if engine is not None else model
        logged = []
        for i, row in enumerate(rows):
            if sp_group is not None:
                shard = next(iter(UlyssesSPDataLoaderAdapter(
                    [row], sp_rank=ctx.sp_rank, sp_group=sp_group, sp_world_size=ctx.sp_size,
                    device="cpu")))
            else:
                shard = dict(row)
                shard["shift_labels"] = torch.nn.functional.pad(
                    shard.pop("labels"), (0, 1), value=IGNORE)[..., 1:]
            if mistake == "shift_after":  # each shard shifts its own labels: the last is lost
                shard["shift_labels"] = shard["shift_labels"].clone()
                shard["shift_labels"][..., -1] = IGNORE
            inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"],
                      "shift_labels": shard["shift_labels"], "use_cache": False}
            if mistake not in ("tutorial", "local_mean") and sp_group is not None:
                loss = deepspeed_sp_compute_loss(None, run, inputs, False,
                                                 _Parallelism(ctx.sp_size))
            else:
                inputs["labels"] = inputs["shift_labels"]
                loss = run(**inputs).loss
                if mistake == "tutorial" and sp_group is not None:
                    loss = _tutorial_aggregation(loss, inputs["shift_labels"], sp_group,
                                                 ctx.sp_size)
            if fixed and not torch.is_tensor(loss):
                loss = sum(p.sum() for p in model.parameters()) * 0.0
            grad_loss = loss / ctx.sp_size if fixed else loss
            if engine is not None:
                engine.backward(grad_loss)
                if i + 1 < len(rows):
                    engine.step()   # between micro-steps: no optimizer step, gradients kept
            else:
                (grad_loss / len(rows)).backward()
            logged.append(float(loss.detach()))
        if engine is None:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)   # the world: the SP × DP group
                    p.grad /= ctx.dp_size
        elif zero_stage >= 1:   # the full gradients of the optimizer's shards
            ctx.grads = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
        return sum(logged) / len(logged)

    step.__name__ = "alst_step(%s, zero %d%s)" % (mistake or "trainer", zero_stage,
                                                   ", fixed" if fixed else "")
    return step


def _tutorial_aggregation(loss, shift_labels, group, sp_size):
    """The SP tutorials' aggregation: every rank's mean weighted by its valid labels."""
    losses = torch.distributed.nn.functional.all_gather(loss, group=group)
    good = (shift_labels != IGNORE).view(-1).sum()
    goods = torch.distributed.nn.functional.all_gather(good, group=group)
    total = sum(losses[r] * goods[r] for r in range(sp_size))
    return total / max(sum(goods), 1)
