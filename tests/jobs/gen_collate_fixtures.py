#!/usr/bin/python3
"""Generate golden fixtures for `seqpar collate` by running the frameworks' real SP collators on CPU.

Our own driver (stdlib + torch only). It imports, from local work trees of the framework repositories,
only the modules the SP collators need; package __init__ files and heavy dependencies (transformers,
process groups, device meshes) are replaced by minimal stand-ins in sys.modules. The parallel-state
getter the collator calls in __post_init__ is replaced by a tiny object carrying the sizes and the rank
we want, so the collator's own __call__ runs unmodified once per cp rank.

    /usr/bin/python3 tests/jobs/gen_collate_fixtures.py \
        --xorl /tmp/fw/xorl --veomni /tmp/fw/veomni --out tests/equivalence/data/collate

--xorl    work tree of github.com/togethercomputer/xorl (contains src/xorl/)
--veomni  work tree of github.com/ByteDance-Seed/VeOmni (contains veomni/)
"""

import argparse
import importlib
import importlib.util
import json
import os
import random
import sys
import types

import torch

IGNORE = -100


# --------------------------------------------------------------------------------------------------
# Loading the frameworks' modules
# --------------------------------------------------------------------------------------------------

def _pkg(name, path=None):
    """Register an empty package (its __init__ is NOT executed) so submodules import from `path`."""
    m = types.ModuleType(name)
    m.__path__ = [path] if path else []
    sys.modules[name] = m
    return m


def _load_file(modname, path):
    spec = importlib.util.spec_from_file_location(modname, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[modname] = m
    spec.loader.exec_module(m)
    return m


class _State:
    """Stand-in for the frameworks' ParallelState: only the attributes the SP collators read."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


_XORL_STATE = [None]
_VEOMNI_STATE = [None]


def load_xorl(root):
    src = os.path.join(root, "src", "xorl")
    _pkg("xorl", src)
    _pkg("xorl.data", os.path.join(src, "data"))
    _pkg("xorl.data.collators", os.path.join(src, "data", "collators"))
    _pkg("xorl.utils", os.path.join(src, "utils"))
    _pkg("xorl.distributed", os.path.join(src, "distributed"))
    ps = types.ModuleType("xorl.distributed.parallel_state")
    ps.get_parallel_state = lambda: _XORL_STATE[0]
    sys.modules["xorl.distributed.parallel_state"] = ps
    return importlib.import_module("xorl.data.collators.sequence_shard_collator")


def load_veomni(root):
    src = os.path.join(root, "veomni")
    _pkg("veomni", src)
    _pkg("veomni.data", os.path.join(src, "data"))
    _pkg("veomni.utils", os.path.join(src, "utils"))
    _pkg("veomni.distributed", os.path.join(src, "distributed"))
    # transformers is not installable here; the collator module only imports ModelOutput by name.
    if "transformers" not in sys.modules:
        tf = _pkg("transformers")
        mo = types.ModuleType("transformers.modeling_outputs")
        mo.ModelOutput = type("ModelOutput", (dict,), {})
        sys.modules["transformers.modeling_outputs"] = mo
        tf.modeling_outputs = mo
    sp = types.ModuleType("veomni.distributed.sequence_parallel")
    sp.gather_outputs = lambda *a, **k: None  # imported by name, unused by the collator
    sys.modules["veomni.distributed.sequence_parallel"] = sp
    ps = types.ModuleType("veomni.distributed.parallel_state")
    ps.get_parallel_state = lambda: _VEOMNI_STATE[0]
    sys.modules["veomni.distributed.parallel_state"] = ps
    collator_mod = importlib.import_module("veomni.data.data_collator")

    # The real ParallelState class, only to reproduce its refusal of cp (ring) > 1.
    real_ps = None
    try:
        if "torch.distributed.device_mesh" not in sys.modules:
            try:
                importlib.import_module("torch.distributed.device_mesh")
            except Exception:  # torch 1.13 has no device_mesh: names are imported only
                dm = types.ModuleType("torch.distributed.device_mesh")
                dm.DeviceMesh = type("DeviceMesh", (), {})
                dm.init_device_mesh = lambda *a, **k: None
                sys.modules["torch.distributed.device_mesh"] = dm
        dev = types.ModuleType("veomni.utils.device")
        dev.get_device_type = lambda: "cpu"
        sys.modules["veomni.utils.device"] = dev
        real_ps = _load_file("veomni.distributed._real_parallel_state",
                             os.path.join(src, "distributed", "parallel_state.py"))
    except Exception as e:  # pragma: no cover
        print("warning: could not load VeOmni's real parallel_state.py:", repr(e), file=sys.stderr)
    finally:
        sys.modules["veomni.distributed.parallel_state"] = ps
    return collator_mod, real_ps


# --------------------------------------------------------------------------------------------------
# Running one case
# --------------------------------------------------------------------------------------------------

def _lst(t):
    return [int(v) for v in t.reshape(-1).tolist()]


def _err(e):
    return f"{type(e).__name__}: {e}"


def _batch_tensors(batch):
    out = {}
    for k in ("input_ids", "labels", "position_ids", "attention_mask"):
        if k in batch:
            out[k] = torch.tensor(batch[k], dtype=torch.long).unsqueeze(0)
    return out


def _rank_entry(r, out):
    """What one cp rank received, in the fixture's keys; q and k cu_seqlens must agree."""
    cu_q, cu_k = out["cu_seq_lens_q"], out["cu_seq_lens_k"]
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k), (cu_q, cu_k)
    assert out["max_length_q"] == out["max_length_k"] and isinstance(out["max_length_q"], int)
    rank = {
        "cp_rank": r,
        "input_ids": _lst(out["input_ids"]),
        "labels": _lst(out["labels"]),
        "position_ids": _lst(out["position_ids"]),
    }
    if "attention_mask" in out:
        rank["attention_mask"] = _lst(out["attention_mask"])
    rank["cu_seqlens"] = _lst(cu_q)
    rank["max_seqlen"] = int(out["max_length_q"])
    return rank


def run_xorl(mod, U, R, pad_token_id, batch):
    C = U * R
    ranks = []
    for r in range(C):
        _XORL_STATE[0] = _State(cp_size=C, cp_rank=r, ringattn_size=R, ulysses_size=U)
        coll = mod.TextSequenceShardCollator(pad_token_id=pad_token_id)
        try:
            out = coll(_batch_tensors(batch))
        except Exception as e:
            e.seqpar_cp_rank = r
            raise
        ranks.append(_rank_entry(r, out))
    # The padded length the collator builds (before zigzag, which can drop tokens: see README).
    pm = 2 * C if R > 1 else C
    L = len(batch["input_ids"])
    padded = (L + pm - 1) // pm * pm
    return {"profile": "xorl", "ulysses": U, "ring": R, "cp_size": C,
            "original_length": len(batch["input_ids"]), "padded_length": padded, "ranks": ranks}


def run_veomni(mod, U, R, batch):
    coll_mod, real_ps = mod
    C = U * R
    if R > 1:
        # VeOmni's ParallelState refuses cp (ring attention) > 1 in __post_init__, before any collator runs.
        if real_ps is None:
            raise RuntimeError("cannot reproduce VeOmni cp>1 refusal: real parallel_state not loaded")
        real_ps.ParallelState(dp_size=1, cp_size=R, ulysses_size=U)
        raise AssertionError("VeOmni ParallelState accepted cp_size > 1 (unexpected)")
    ranks = []
    for r in range(C):
        _VEOMNI_STATE[0] = _State(sp_size=C, sp_rank=r, sp_enabled=C > 1)
        coll = coll_mod.SequenceParallelCollator()
        try:
            out = coll(_batch_tensors(batch))
        except Exception as e:
            e.seqpar_cp_rank = r
            raise
        assert torch.equal(out["cu_seq_lens_q"], out["linear_attn_cu_seq_lens_q"])
        rank = _rank_entry(r, out)
        if "tail_padding_length" in out:
            t = out["tail_padding_length"]
            assert t.dtype == torch.int32 and t.dim() == 0
            rank["tail_padding_length"] = int(t)
        ranks.append(rank)
    padded = len(ranks[0]["input_ids"]) * C
    return {"profile": "veomni", "ulysses": U, "ring": R, "cp_size": C,
            "original_length": len(batch["input_ids"]), "padded_length": padded, "ranks": ranks}


# --------------------------------------------------------------------------------------------------
# Building packed rows the way each framework's upstream packing produces them
# --------------------------------------------------------------------------------------------------

class Tok:
    """Deterministic distinct token ids so every position is recognisable in the output."""

    def __init__(self, start=1):
        self.n = start

    def take(self, k):
        v = list(range(self.n, self.n + k))
        self.n += k
        return v


def _mask_prompt(labels, mask_prompt, i):
    """Doc i's labels with its first mask_prompt[i] set to -100 (prompt masking)."""
    m = min(mask_prompt[i] if mask_prompt else 0, len(labels))
    return [IGNORE] * m + list(labels[m:])


def _pack(samples, start_pos, attention_mask):
    """One packed row from (input_ids, labels) samples; position_ids restart at every sample,
    the first one at start_pos."""
    ids, labels, pos = [], [], []
    for i, (t, lab) in enumerate(samples):
        ids += t
        labels += lab
        off = start_pos if i == 0 else 0
        pos += list(range(off, off + len(t)))
    b = {"input_ids": ids, "labels": labels, "position_ids": pos}
    if attention_mask:
        b["attention_mask"] = [1] * len(ids)
    return b


def xorl_row(doc_lens, tok, mask_prompt=None, attention_mask=False, upstream_pad=0, start_pos=0):
    """xorl: each sample shifted before packing (input=t[:-1], labels=t[1:], pos=arange(len-1)).

    mask_prompt: per doc, number of leading labels set to -100 (prompt masking).
    upstream_pad: tokens of padding added by the upstream PackingConcatCollator
                  (ids 0, labels -100, attention_mask 0, position_ids arange % 1024).
    start_pos: position offset of the first doc (a row that does not start at 0).
    """
    samples = []
    for i, n in enumerate(doc_lens):
        raw = tok.take(n + 1)
        samples.append((raw[:-1], _mask_prompt(raw[1:], mask_prompt, i)))
    b = _pack(samples, start_pos, attention_mask)
    if upstream_pad:
        b["input_ids"] += [0] * upstream_pad
        b["labels"] += [IGNORE] * upstream_pad
        b["position_ids"] += [p % 1024 for p in range(upstream_pad)]
        if attention_mask:
            b["attention_mask"] += [0] * upstream_pad
    return b


def veomni_row(doc_lens, tok, mask_prompt=None, attention_mask=False, start_pos=0, labels_eq_ids=True):
    """VeOmni: unshifted samples (labels = input_ids, optional prompt masking); PackingCollator sets
    labels[0] = -100 of every sample after the first and concatenates; position_ids arange per sample."""
    samples = []
    for i, n in enumerate(doc_lens):
        t = tok.take(n)
        lab = _mask_prompt(list(t) if labels_eq_ids else [v + 1000 for v in t], mask_prompt, i)
        if i > 0:
            lab[0] = IGNORE
        samples.append((t, lab))
    return _pack(samples, start_pos, attention_mask)


def rand_docs(rng, total, align=1, min_len=1):
    """Random doc lengths summing to `total`, each a multiple of `align` and >= min_len."""
    units = total // align
    docs = []
    while units > 0:
        k = rng.randint(max(1, -(-min_len // align)), max(1, min(units, max(1, units))))
        k = min(k, units)
        docs.append(k * align)
        units -= k
    return docs


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------

def build_cases():
    rng = random.Random(20240607)
    cases = []

    def add(name, profile, U, R, pad, batch, note="", big=False):
        cases.append(dict(name=name, profile=profile, ulysses=U, ring=R, pad_token_id=pad, batch=batch, note=note,
                          big=big))

    # ---------------- xorl: SEMANTICS worked examples ----------------
    # C=4, R=1, docs [4,6], pad 7, ids 1..10.
    tok = Tok(1)
    b = {"input_ids": list(range(1, 11)), "position_ids": [0, 1, 2, 3, 0, 1, 2, 3, 4, 5],
         "labels": [2, 3, 4, 101, 6, 7, 8, 9, 10, 102]}
    add("xorl_sem_c4_docs4_6_pad7", "xorl", 4, 1, 7, b, "SEMANTICS §1 worked example")
    # zigzag docs [8,4], R=2, ids = 0..11 (positions identify tokens)
    b = {"input_ids": list(range(12)), "position_ids": list(range(8)) + list(range(4)),
         "labels": list(range(1, 8)) + [IGNORE] + list(range(9, 12)) + [IGNORE]}
    add("xorl_sem_zigzag_docs8_4_r2", "xorl", 1, 2, 0, b, "SEMANTICS §2 zigzag example")
    b = {"input_ids": list(range(16)), "position_ids": list(range(8)) * 2,
         "labels": list(range(1, 8)) + [IGNORE] + list(range(9, 16)) + [IGNORE]}
    add("xorl_sem_hybrid_u2_r2_docs8_8", "xorl", 2, 2, 0, b, "SEMANTICS §2 hybrid example")
    # 6 tokens, C=9, R=3 -> N=18: some ranks hold only padding
    add("xorl_short_l6_u3_r3", "xorl", 3, 3, 0, xorl_row([6], Tok(1)), "short row, padding-only ranks")
    add("xorl_short_l6_u9_r1", "xorl", 9, 1, 0, xorl_row([6], Tok(1)), "short row, padding-only ranks")
    add("xorl_short_l1_u8_r1", "xorl", 8, 1, 0, xorl_row([1], Tok(1)), "1 token, 7 padding-only ranks")
    add("xorl_short_l2_u4_r2", "xorl", 4, 2, 0, xorl_row([2], Tok(1), attention_mask=True),
        "2-token doc with R=2: not divisible by 4 -> error")
    add("xorl_short_l4_u4_r2", "xorl", 4, 2, 0, xorl_row([4], Tok(1), attention_mask=True),
        "4 tokens, N=16: padding-only ranks")

    # ---------------- xorl: grid U 1..8, R 1..4 ----------------
    for U in range(1, 9):
        for R in range(1, 5):
            if U * R > 16 and (U, R) not in ((8, 3), (8, 4)):
                continue
            if R == 1 and U in (1,):
                # identity
                add("xorl_identity_u1_r1", "xorl", 1, 1, 0, xorl_row([5, 3], Tok(1), attention_mask=True),
                    "U=R=1: what the collator returns with size 1, rank 0")
                continue
            C = U * R
            align = 2 * R if R > 1 else 1
            pm = 2 * C if R > 1 else C
            # vary: aligned total or not, attention mask, pad id, prompt masking
            total = rng.randint(1, 4) * pm if rng.random() < 0.3 else rng.randint(pm // 2 + 1, 3 * pm)
            total = max(align, total - total % align)
            docs = rand_docs(rng, total, align=align, min_len=1)
            am = rng.random() < 0.5
            pad = rng.choice([0, 0, 7, 151643])
            mp = [rng.choice([0, 0, 1, 3]) for _ in docs]
            add(f"xorl_grid_u{U}_r{R}", "xorl", U, R, pad,
                xorl_row(docs, Tok(rng.randint(1, 50) * 100), mask_prompt=mp, attention_mask=am),
                f"grid docs={docs}")

    # ---------------- xorl: specific behaviours ----------------
    add("xorl_aligned_nopad_u4_r1", "xorl", 4, 1, 0, xorl_row([3, 5, 4], Tok(1), attention_mask=True),
        "L=12 multiple of C: no padding")
    add("xorl_aligned_nopad_u2_r2", "xorl", 2, 2, 0, xorl_row([4, 12], Tok(1)), "L=16 multiple of 2C")
    add("xorl_onetoken_docs_u4_r1", "xorl", 4, 1, 3, xorl_row([1, 1, 1, 2, 1], Tok(1)), "1-token docs")
    add("xorl_many_docs_u2_r1", "xorl", 2, 1, 0, xorl_row([3, 1, 7, 2, 2, 5, 1, 4], Tok(1), mask_prompt=[1, 0, 3, 0, 2, 0, 0, 4]),
        "many docs, -100 runs")
    add("xorl_many_docs_u2_r2", "xorl", 2, 2, 0,
        xorl_row([4, 8, 4, 12, 4], Tok(1), mask_prompt=[2, 5, 0, 12, 1], attention_mask=True),
        "many docs zigzag, one fully masked doc")
    add("xorl_all_masked_u2_r1", "xorl", 2, 1, 0, xorl_row([3, 4], Tok(1), mask_prompt=[3, 4]),
        "all labels -100 (shift check has nothing to compare)")
    add("xorl_misaligned_r2", "xorl", 1, 2, 0, xorl_row([5, 3], Tok(1)), "doc 5 not divisible by 4 -> error")
    add("xorl_misaligned_u2_r2", "xorl", 2, 2, 0, xorl_row([4, 6], Tok(1)), "doc 6 not divisible by 4")
    add("xorl_misaligned_onetoken_r2", "xorl", 1, 2, 0, xorl_row([4, 1, 3], Tok(1)), "1-token doc with R=2")
    add("xorl_aligned_docs_sp_pad_r2", "xorl", 1, 2, 0, xorl_row([4, 8, 4], Tok(1)),
        "aligned docs, L=16 no padding at pm=4 (control)")
    add("xorl_aligned_docs_sp_pad_u3_r2", "xorl", 3, 2, 0, xorl_row([4, 8, 4], Tok(1)),
        "aligned docs L=16, pm=12 -> N=24, SP pad doc of 8")
    # upstream packing pad (attention_mask 0) creating a misaligned pad doc
    add("xorl_upstream_pad_r1", "xorl", 4, 1, 0, xorl_row([5, 4], Tok(1), attention_mask=True, upstream_pad=2),
        "upstream PackingConcatCollator padding (mask 0) then SP padding (mask 1)")
    add("xorl_upstream_pad_misaligned_r2", "xorl", 1, 2, 0,
        xorl_row([4, 8], Tok(1), attention_mask=True, upstream_pad=2),
        "upstream pad doc of 2 tokens is a document for zigzag -> error")
    add("xorl_upstream_pad_aligned_r2", "xorl", 2, 2, 0,
        xorl_row([4, 8], Tok(1), attention_mask=True, upstream_pad=4), "upstream pad doc of 4 tokens")
    # rows not starting at position 0
    add("xorl_nonzero_start_r1", "xorl", 2, 1, 0, xorl_row([5, 4], Tok(1), start_pos=3, attention_mask=True),
        "row starts at position 3 (continuation), R=1")
    add("xorl_nonzero_start_r2", "xorl", 1, 2, 0, xorl_row([6, 8], Tok(1), start_pos=3),
        "row starts at position 3, R=2, SP pad of 2 is misaligned -> error")
    add("xorl_nonzero_start_r2_drop", "xorl", 1, 2, 0, xorl_row([3, 8], Tok(1), start_pos=5, attention_mask=True),
        "row starts at position 5 (3-token fragment), L=11 -> N=12: SP pad doc of 1 is misaligned -> error")
    add("xorl_nonzero_start_r2_drop4", "xorl", 1, 2, 0, xorl_row([4, 8], Tok(1), start_pos=5, attention_mask=True),
        "row starts at position 5 with a 4-token fragment, L=12, no padding: zigzag drops the fragment")
    add("xorl_nonzero_start_u2_r2", "xorl", 2, 2, 0, xorl_row([4, 8], Tok(1), start_pos=2, attention_mask=True),
        "row starts at position 2, R=2, U=2")
    add("xorl_nonzero_start_u3_r2_narrow", "xorl", 3, 2, 0, xorl_row([4, 8], Tok(1), start_pos=1),
        "4-token leading fragment dropped by zigzag: 8 tokens left for C=6 ranks of ceil(8/6)=2")
    add("xorl_nonzero_start_only_r2", "xorl", 1, 2, 0, xorl_row([8], Tok(1), start_pos=5),
        "single doc not starting at 0, R=2 (only padding has a 0)")
    # shift check failure (labels not shifted)
    b = xorl_row([4, 4], Tok(1))
    b["labels"] = list(b["input_ids"])
    add("xorl_unshifted_labels_error", "xorl", 2, 1, 0, b, "labels == input_ids: shift sanity check fails")
    # non-monotone / positions reset mid doc (qwen-like) -- behaves as new doc at each 0
    add("xorl_pad_nonzero_id_u3_r1", "xorl", 3, 1, 151643, xorl_row([7, 3], Tok(1), attention_mask=True),
        "pad_token_id 151643")
    add("xorl_pad_nonzero_id_u3_r2", "xorl", 3, 2, 99, xorl_row([4, 8, 4], Tok(1)), "pad_token_id 99, L=16 -> N=24")
    # padding beyond 1024: needs 2C > 1024 + L. R=3 -> pad doc pieces [1024, rest] and 1024 % 6 != 0.
    add("xorl_pad_over_1024_u174_r3", "xorl", 174, 3, 0, xorl_row([6], Tok(1)),
        "L=6, C=522, N=1044: pad 1038 = [1024,14] pad docs, 1024 not divisible by 6 -> error")
    # padding beyond 1024 that succeeds: R=2, C=520, pm=1040, L=8 -> pad 1032 = pad docs [1024, 8].
    add("xorl_pad_over_1024_u260_r2", "xorl", 260, 2, 0, xorl_row([8], Tok(1), attention_mask=True),
        "L=8, C=520, N=1040: SP pad of 1032 tokens has position_ids arange(1032) % 1024",
        big=True)  # 3.2 MB (520 ranks x 1040 full position_ids): only with --big
    # long single doc
    add("xorl_long_doc_u8_r4", "xorl", 8, 4, 0, xorl_row([128, 64], Tok(1), mask_prompt=[10, 0]),
        "L=192, pm=64, no padding")
    add("xorl_long_doc_u8_r1", "xorl", 8, 1, 0, xorl_row([100, 37], Tok(1), attention_mask=True), "L=137 -> 144")

    # ---------------- VeOmni ----------------
    b = {"input_ids": [11, 12, 13, 21, 22, 23, 24], "labels": [11, 12, 13, IGNORE, 22, 23, 24],
         "position_ids": [0, 1, 2, 0, 1, 2, 3]}
    add("veomni_sem_u3", "veomni", 3, 1, 0, b, "SEMANTICS §1 worked example")
    b = dict(b, attention_mask=[1] * 7)
    add("veomni_sem_u3_mask", "veomni", 3, 1, 0, b, "worked example with attention_mask")
    add("veomni_identity_u1", "veomni", 1, 1, 0, veomni_row([5, 3], Tok(1), attention_mask=True),
        "U=1 (collator called with size 1, rank 0)")
    for U in range(2, 9):
        for variant in range(2):
            total = rng.randint(U // 2 + 1, 4 * U)
            if variant == 1:
                total = U * rng.randint(1, 4)  # aligned: no padding
            docs = rand_docs(rng, total)
            am = rng.random() < 0.5
            mp = [rng.choice([0, 0, 1, 2]) for _ in docs]
            add(f"veomni_grid_u{U}_{'aligned' if variant else 'padded'}", "veomni", U, 1, 0,
                veomni_row(docs, Tok(rng.randint(1, 50) * 100), mask_prompt=mp, attention_mask=am),
                f"grid docs={docs}")
    add("veomni_nopad_u4", "veomni", 4, 1, 0, veomni_row([3, 5], Tok(1), attention_mask=True),
        "L=8 multiple of U: no padding, no tail_padding_length")
    add("veomni_nopad_tail_onetoken_docs_u4", "veomni", 4, 1, 0, veomni_row([5, 1, 1, 1], Tok(1)),
        "no padding, row ends in 1-token docs (not coalesced)")
    add("veomni_pad_after_onetoken_doc_u4", "veomni", 4, 1, 0, veomni_row([4, 1], Tok(1)),
        "last real doc is 1 token then 3 pad tokens: tail coalescing must keep it")
    add("veomni_onetoken_docs_u3", "veomni", 3, 1, 0, veomni_row([1, 1, 1, 1, 1], Tok(1)), "only 1-token docs")
    add("veomni_short_l2_u8", "veomni", 8, 1, 0, veomni_row([2], Tok(1), attention_mask=True),
        "2 tokens, U=8: six padding-only ranks")
    add("veomni_short_l1_u5", "veomni", 5, 1, 0, veomni_row([1], Tok(1)), "1 token, U=5")
    add("veomni_many_docs_u2", "veomni", 2, 1, 0,
        veomni_row([3, 1, 7, 2, 2, 5, 1, 4], Tok(1), mask_prompt=[1, 0, 3, 0, 2, 0, 0, 4]),
        "many docs, -100 runs")
    add("veomni_nonzero_start_u2", "veomni", 2, 1, 0, veomni_row([5, 4], Tok(1), start_pos=3),
        "row starts at position 3")
    add("veomni_nonzero_start_only_u4", "veomni", 4, 1, 0, veomni_row([6], Tok(1), start_pos=7, attention_mask=True),
        "single doc not starting at 0, then 2 pad tokens")
    add("veomni_nonzero_start_nopad_u2", "veomni", 2, 1, 0, veomni_row([6], Tok(1), start_pos=7),
        "single doc not starting at 0, no padding: cu has no 0 entry")
    add("veomni_pad_token_id_ignored_u3", "veomni", 3, 1, 7, veomni_row([4, 3], Tok(1)),
        "pad_token_id=7 given, VeOmni pads input_ids with its collate-info value 0")
    add("veomni_labels_differ_u2", "veomni", 2, 1, 0, veomni_row([3, 4], Tok(1), labels_eq_ids=False),
        "labels != input_ids (shift is applied blindly)")
    add("veomni_cp2_u2_error", "veomni", 2, 2, 0, veomni_row([4, 4], Tok(1)), "cp (ring) = 2: VeOmni refuses")
    add("veomni_cp3_u1_error", "veomni", 1, 3, 0, veomni_row([6], Tok(1)), "cp (ring) = 3: VeOmni refuses")
    add("veomni_long_u8", "veomni", 8, 1, 0, veomni_row([100, 37, 1], Tok(1), attention_mask=True, mask_prompt=[20, 5, 0]),
        "L=138 -> 144")
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xorl", help="omitted: the xorl cases are not run")
    ap.add_argument("--veomni", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None, help="substring filter on case names")
    ap.add_argument("--big", action="store_true", help="also write the large (multi-MB) cases")
    args = ap.parse_args()

    xorl = load_xorl(args.xorl) if args.xorl else None
    veomni = load_veomni(args.veomni)
    os.makedirs(args.out, exist_ok=True)

    names = set()
    for case in build_cases():
        name = case["name"]
        assert name not in names, name
        names.add(name)
        if args.only and args.only not in name:
            continue
        if case["big"] and not args.big:
            continue
        if case["profile"] == "xorl" and xorl is None:
            continue
        U, R, pad, batch = case["ulysses"], case["ring"], case["pad_token_id"], case["batch"]
        doc = {"name": name, "profile": case["profile"], "ulysses": U, "ring": R, "pad_token_id": pad,
               "note": case["note"], "batch": batch}
        try:
            if case["profile"] == "xorl":
                doc["expected"] = run_xorl(xorl, U, R, pad, batch)
            else:
                doc["expected"] = run_veomni(veomni, U, R, batch)
        except (AssertionError, ValueError, NotImplementedError, RuntimeError, IndexError) as e:
            doc["error"] = _err(e)
            # the first cp rank whose collator call raised (absent: raised before any collator ran)
            if hasattr(e, "seqpar_cp_rank"):
                doc["error_cp_rank"] = e.seqpar_cp_rank
        path = os.path.join(args.out, name + ".json")
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")
        status = "ERROR " + doc["error"] if "error" in doc else f"ok N={doc['expected']['padded_length']}"
        print(f"{name}: {status}")


if __name__ == "__main__":
    main()
