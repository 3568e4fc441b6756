"""VeOmni's training step under seqpar's step property (check_step): VeOmni's own model code (its
patched Qwen3, built by veomni.models.build_foundation_model), its parallel state (Ulysses × DP
device mesh), its collator (MainCollator: packing, the labels shifted before the SP cut, SP
padding, the flash-attention kwargs of the full sequence), its Ulysses attention
(veomni_flash_attention_2_with_sp: the all-to-alls around the kernel), its SP loss reduction
(reduce_sequence_parallel_loss) and its trainer's per-micro-batch loss scaling
(veomni.utils.loss_utils: count_loss_token, reduce_global_loss_token, mean_global_loss) — run
on CPU gloo ranks:

    python3 -m seqpar.testing check-step "python/examples/veomni_step.py:make_step()" \\
        --hf-config tests/python/data/hf_configs/qwen3-8b.json --attn seqpar_varlen \\
        --max-ring 1 --ulysses 2,4 --dtypes f64,f32 --seed 0

What is ours, because it cannot run on a CPU: the attention kernel under VeOmni's Ulysses
wrapper (seqpar.testing.hf.flash_forward, flash-attn's varlen contract: the documents of the
collator's cu_seq_lens), and the gradient reduction, which VeOmni leaves to FSDP2 over its
dp × sp mesh (a sum over that group divided by its size — FSDP2's default averaging — done here
with one all_reduce per parameter; FSDP2's reduce-scatter does not run on gloo). In float64
the model's loss is VeOmni's ForCausalLMLoss without its float32 upcast of the logits (the SP
reduction is still VeOmni's reduce_sequence_parallel_loss), and the logged loss is reduced in
float64 (VeOmni's logging all_reduce makes a float32 tensor of it).

One mistake is a keyword away, to show what a missing factor looks like:
  'no_sp_divide'   mean_global_loss without its division by the SP size (VeOmni's reduction
                   multiplies each rank's gradient by the SP size, as FSDP averages over the SP
                   ranks too): every gradient is SP-size times the loss's
"""
import os

import torch
import torch.distributed as dist

# VeOmni's logger prints its environment and collator tables at INFO, from every rank.
os.environ.setdefault("VEOMNI_VERBOSITY", "WARNING")

IGNORE = -100

_STATE = {}   # per process: the parallel state's topology and VeOmni's model per config


def _parallel_state(ctx):
    """VeOmni's parallel state for this example's dp × Ulysses (rebuilt when it changes); its
    SP groups must be seqpar's (consecutive world ranks)."""
    from veomni.distributed.parallel_state import (clear_parallel_state, get_parallel_state,
                                                   init_parallel_state)
    key = (ctx.world_size, ctx.dp_size, ctx.sp_size)
    if _STATE.get("topology") != key:
        clear_parallel_state()
        init_parallel_state(dp_size=ctx.dp_size, ulysses_size=ctx.sp_size, device_type="cpu")
        _STATE["topology"] = key
    ps = get_parallel_state()
    if ctx.sp_size > 1 and ps.sp_rank != ctx.sp_rank:
        raise RuntimeError("VeOmni's mesh puts world rank %d at SP rank %d, seqpar at %d" % (
            ctx.rank, ps.sp_rank, ctx.sp_rank))
    return ps


def _veomni_model(model, dtype):
    """VeOmni's build of the same architecture (its patched modeling), with `model`'s weights.
    Built with eager attention (the flash path checks for flash-attn at build time), then
    switched to VeOmni's Ulysses flash path, whose kernel is seqpar's CPU one."""
    import veomni.ops.kernels.attention.flash as veomni_flash
    from veomni.arguments.arguments_types import OpsImplementationConfig
    from veomni.models import build_foundation_model

    from seqpar.testing.hf import flash_forward
    veomni_flash._flash_attention_forward = flash_forward
    key = (model.config.to_json_string(), dtype)
    if key not in _STATE:
        cfg = model.config.__class__.from_dict(model.config.to_dict())
        cfg.architectures = cfg.architectures or [type(model).__name__]
        ops = OpsImplementationConfig(
            attn_implementation="eager", cross_entropy_loss_implementation="eager",
            moe_implementation="eager", rms_norm_implementation="eager",
            swiglu_mlp_implementation="eager", rotary_pos_emb_implementation="eager",
            load_balancing_loss_implementation="eager")
        vm = build_foundation_model(cfg, torch_dtype="float32", init_device="cpu",
                                    ops_implementation=ops).to(dtype)
        vm.config._attn_implementation = "veomni_flash_attention_2_with_sp"
        _STATE[key] = vm
    vm = _STATE[key]
    vm.load_state_dict(model.state_dict())
    vm.zero_grad(set_to_none=True)
    return vm


def _f64_loss(logits=None, labels=None, vocab_size=None, num_items_in_batch=None,
              ignore_index=IGNORE, shift_labels=None, **kwargs):
    """VeOmni's ForCausalLMLoss (eager cross-entropy) in the logits' own dtype: the logits (from
    the hidden states and the head's weights where the model passes those instead), the same
    shift (none under SP: the collator shifted), transformers' fixed_cross_entropy, and VeOmni's
    SP reduction."""
    from transformers.loss.loss_utils import fixed_cross_entropy
    from veomni.distributed.parallel_state import get_parallel_state
    from veomni.distributed.sequence_parallel import reduce_sequence_parallel_loss
    sp = get_parallel_state().sp_enabled
    if logits is None:   # the fused path's inputs (gpt-oss's modeling passes no logits)
        logits = torch.nn.functional.linear(kwargs["hidden_states"], kwargs["weights"])
    if not sp and shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    elif sp:
        shift_labels = labels
    loss = fixed_cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                               num_items_in_batch, ignore_index)
    if sp:
        loss = reduce_sequence_parallel_loss(loss, (labels != ignore_index).sum())
    return loss, logits, None


def _samples(batch):
    """A micro-batch's rows as the samples a VeOmni dataset yields: one per packed document
    (input_ids, labels, position_ids), a row's padding run being one of its own."""
    out = []
    for b in range(batch["input_ids"].shape[0]):
        pos = batch["position_ids"][b]
        starts = [i for i in range(len(pos)) if i == 0 or int(pos[i]) == 0] + [len(pos)]
        for a, e in zip(starts, starts[1:]):
            out.append({"input_ids": batch["input_ids"][b, a:e].clone(),
                        "labels": batch["labels"][b, a:e].clone(),
                        "attention_mask": torch.ones(e - a, dtype=torch.long),
                        "position_ids": batch["position_ids"][b, a:e].clone()})
    return out


def make_step(mistake=None):
    """The per-rank step, as VeOmni's BaseTrainer.train_step runs it: every micro-batch collated
    by VeOmni's MainCollator for this rank, the step's loss-token counts (count_loss_token,
    reduce_global_loss_token), per micro-batch the model's loss scaled by mean_global_loss and
    backpropagated; then the gradients averaged over the FSDP group (dp × sp) and the logged
    loss (the scaled losses summed, averaged over that group)."""
    if mistake not in (None, "no_sp_divide"):
        raise ValueError("veomni_step: unknown mistake %r" % (mistake,))

    # Imported here, in the process that calls make_step (seqpar.testing's own, which forks the
    # ranks), so that every rank inherits them: imported inside step(), each rank of each pool
    # paid for them again (VeOmni's and transformers' ~5 s of CPU).
    import transformers.loss.loss_utils  # noqa: F401
    import veomni.arguments.arguments_types  # noqa: F401
    from veomni.data.data_collator import MainCollator
    from veomni.utils import loss_utils
    import veomni.distributed.parallel_state  # noqa: F401
    import veomni.distributed.sequence_parallel  # noqa: F401
    import veomni.models  # noqa: F401
    import veomni.ops.kernels.attention.flash  # noqa: F401

    def step(model, batches, ctx):
        ps = _parallel_state(ctx)
        vm = _veomni_model(model, ctx.dtype)
        if ctx.dtype == torch.float64:
            vm.loss_function = _f64_loss
        collate = MainCollator()
        micro = [collate(_samples(b)) for b in batches]
        tokens = loss_utils.count_loss_token(micro)
        global_tokens = loss_utils.reduce_global_loss_token(tokens)
        logged = 0.0
        for mb in micro:
            inputs = {k: v for k, v in mb.items() if k != "attention_mask"}
            out = vm(**inputs, use_cache=False)
            losses = loss_utils.mean_global_loss(
                out.loss, loss_utils.count_loss_token(mb), tokens, global_tokens)
            loss = torch.stack(list(losses.values())).sum()
            if mistake == "no_sp_divide":
                loss = loss * ps.sp_size
            loss.backward()
            logged += float(loss.detach())
        # FSDP2's averaging over the dp × sp mesh, and the trainer's logged loss
        size = ps.fsdp_size
        params = dict(model.named_parameters())
        for name, p in vm.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = g.detach().clone()
            dist.all_reduce(g)
            params[name].grad = g / size
        total = torch.tensor(logged, dtype=torch.float64)
        dist.all_reduce(total)
        return float(total) / size

    step.__name__ = "veomni_step(%s)" % (mistake or "trainer")
    return step
