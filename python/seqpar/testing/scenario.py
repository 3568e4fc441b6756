"""Scenarios of the property (one SP attention call) and their layouts.

A scenario names the SP degrees, the ring layout, the heads, head_dim, the packed documents,
the dtype and the data seed. Which tokens a rank holds is never computed here: `layout()` asks
seqpar's own core (`seqpar plan --json`, the DESIGN.md contract), so the Python side holds no
second copy of the zigzag / padding logic.
"""
import dataclasses
import json
import os
import shutil
import subprocess

DTYPES = ("f32", "bf16", "f16")
LAYOUTS = ("zigzag", "contiguous")
PROFILES = ("xorl", "veomni", "deepspeed")


class LayoutRefused(Exception):
    """seqpar refused the scenario (exit 2): the message names the constraint."""


class SeqparNotFound(Exception):
    pass


# The binary named by pytest's --seqpar (plugin.py): explicit, like find_seqpar's argument.
explicit_binary = None


def wheel_binary():
    """The seqpar binary installed with this very package (a wheel puts it in the environment's
    scripts directory), or None when this package does not come from an installed wheel (a
    checkout on PYTHONPATH, or another installation of seqpar than this file's)."""
    try:
        from importlib import metadata
        dist = metadata.distribution("seqpar")
        here = os.path.realpath(__file__)
        if os.path.realpath(str(dist.locate_file("seqpar/testing/scenario.py"))) != here:
            return None
        for f in dist.files or ():
            if f.name == "seqpar" and "bin" in f.parts:
                path = str(dist.locate_file(f))
                if os.path.isfile(path) and os.access(path, os.X_OK):
                    return os.path.realpath(path)
    except Exception:  # no metadata, or metadata of another kind: not a wheel installation
        return None
    return None


def find_seqpar(explicit=None):
    """The seqpar binary: `explicit` (or pytest's --seqpar), the binary of this package's own
    wheel, $SEQPAR, `seqpar` on PATH, or the checkout's build/tools/seqpar beside this package."""
    cands = [explicit, explicit_binary, wheel_binary(), os.environ.get("SEQPAR"),
             shutil.which("seqpar"),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "build",
                          "tools", "seqpar")]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    raise SeqparNotFound(
        "seqpar.testing needs the seqpar binary to lay out and judge examples, and found none: "
        "install the wheel (pip install seqpar, or pip install . in a checkout), build it "
        "(./setup.sh in the checkout: build/tools/seqpar), or set SEQPAR=/path/to/seqpar")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One example: the SP attention call every rank makes."""
    ulysses: int
    ring: int
    layout: str          # zigzag | contiguous (meaningful when ring > 1)
    heads: int
    kv_heads: int
    head_dim: int
    docs: tuple          # document lengths packed in the row, before SP padding
    dtype: str           # f32 | bf16 | f16
    seed: int = 0        # data seed
    q_scale: float = 1.0  # q is drawn N(0, q_scale²): large values make large logits
    profile: str = "xorl"
    causal: bool = True
    # Today's attention options (docs/attention.md), in document positions p (query), k (key):
    # visible iff p − k ≤ window_back (≥ 0), k − p ≤ window_ahead (non-causal, ≥ 0), p // chunk
    # == k // chunk (chunk > 0); scores capped as softcap·tanh(s/softcap) before the mask; sinks:
    # one learnable logit per query head (ctx.sinks), its gradient judged.
    window_back: int = -1
    window_ahead: int = -1
    chunk: int = 0
    softcap: float = 0.0
    sinks: bool = False

    @property
    def world(self):
        return self.ulysses * self.ring

    @property
    def tokens(self):
        return sum(self.docs)

    def to_json(self):
        d = dataclasses.asdict(self)
        d["docs"] = list(self.docs)
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def from_json(text):
        try:
            d = json.loads(text) if isinstance(text, str) else dict(text)
        except ValueError as e:
            raise ValueError("the scenario is not JSON (%s): %r" % (e, text))
        fields = [f.name for f in dataclasses.fields(Scenario)]
        required = [f.name for f in dataclasses.fields(Scenario)
                    if f.default is dataclasses.MISSING]
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ValueError("scenario keys %s are unknown; known: %s" % (unknown, fields))
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError("the scenario lacks %s (required: %s)" % (missing, required))
        d["docs"] = tuple(int(x) for x in d["docs"])
        for k, allowed in (("dtype", DTYPES), ("layout", LAYOUTS), ("profile", PROFILES)):
            if k in d and d[k] not in allowed:
                raise ValueError("scenario %s=%r: use one of %s" % (k, d[k], allowed))
        for k in ("ulysses", "ring", "heads", "kv_heads", "head_dim"):
            if int(d[k]) < 1:
                raise ValueError("scenario %s=%s must be at least 1" % (k, d[k]))
        if int(d.get("window_back", -1)) < -1 or int(d.get("window_ahead", -1)) < -1 or \
                int(d.get("chunk", 0)) < 0 or float(d.get("softcap", 0.0)) < 0:
            raise ValueError("scenario window_back/window_ahead must be >= -1 (-1: none), chunk "
                             "and softcap >= 0 (0: none): %r" % (d,))
        if d.get("causal", True) and int(d.get("window_ahead", -1)) >= 0:
            raise ValueError("scenario window_ahead=%s needs causal false: a causal query sees "
                             "no later key" % d["window_ahead"])
        if not d["docs"] or min(d["docs"]) < 1:
            raise ValueError("scenario docs=%s: every document needs at least one token" %
                             list(d["docs"]))
        return Scenario(**d)

    def describe(self):
        lay = ("" if self.ring == 1 else " %s" % self.layout)
        return ("ulysses %d × ring %d%s (world %d), heads %d / kv %d, head_dim %d, docs %s "
                "(%d tokens), %s, seed %d%s, profile %s%s" % (
                    self.ulysses, self.ring, lay, self.world, self.heads, self.kv_heads,
                    self.head_dim, list(self.docs), self.tokens, self.dtype, self.seed,
                    "" if self.q_scale == 1 else ", q_scale %g" % self.q_scale, self.profile,
                    self.describe_attention()))

    def describe_attention(self):
        """", bidirectional, window 3 back / 1 ahead, sinks" — empty for causal, full attention."""
        parts = [] if self.causal else ["bidirectional"]
        if self.window_back >= 0:
            parts.append("window %d back%s" % (self.window_back, " / %d ahead" % self.window_ahead
                                               if self.window_ahead >= 0 else ""))
        if self.chunk > 0:
            parts.append("chunk %d" % self.chunk)
        if self.sinks:
            parts.append("sinks")
        if self.softcap > 0:
            parts.append("softcap %g" % self.softcap)
        return "".join(", " + p for p in parts)

    def plan_args(self):
        a = ["--profile", self.profile, "--ulysses", str(self.ulysses), "--ring", str(self.ring),
             "--heads", str(self.heads), "--kv-heads", str(self.kv_heads), "--head-dim",
             str(self.head_dim), "--docs", ",".join(str(x) for x in self.docs)]
        if self.ring > 1 and self.layout == "contiguous":
            a.append("--no-zigzag")
        return a


@dataclasses.dataclass(frozen=True)
class Layout:
    """What seqpar's core lays out for a scenario: the padded row, its documents (padding
    included as documents, as the dump format wants), and each cp rank's global token indices."""
    padded_length: int
    original_length: int
    cu_seqlens: tuple        # global, over the padded row; the padding tail is a document
    rank_tokens: tuple       # per cp rank (= ring_rank·U + ulysses_rank), global indices

    def positions(self):
        """Global position ids: index within the document."""
        pos = [0] * self.padded_length
        for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]):
            for t in range(a, b):
                pos[t] = t - a
        return pos

    def doc_of(self):
        doc = [0] * self.padded_length
        for j, (a, b) in enumerate(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])):
            for t in range(a, b):
                doc[t] = j
        return doc


_LAYOUT_CACHE = {}


def layout(scn, seqpar_bin):
    """The layout of scn from `seqpar plan --json` (cached). Raises LayoutRefused with seqpar's
    own message when seqpar refuses the scenario."""
    key = (seqpar_bin,) + tuple(scn.plan_args())
    hit = _LAYOUT_CACHE.get(key)
    if hit is not None:
        return hit
    p = subprocess.run([seqpar_bin, "plan"] + scn.plan_args() + ["--json"], capture_output=True,
                       text=True)
    if p.returncode == 2:
        raise LayoutRefused(p.stderr.strip().replace("seqpar: error: ", ""))
    if p.returncode != 0:
        raise RuntimeError("seqpar plan failed (exit %d): %s" % (p.returncode, p.stderr.strip()))
    j = json.loads(p.stdout)
    cu = [int(x) for x in j["cu_seqlens"]]
    n = int(j["padded_length"])
    if cu[-1] < n:  # xorl with ring > 1: cu_seqlens from the unpadded ids; the tail is a document
        cu.append(n)
    ranks = sorted(j["ranks"], key=lambda r: r["cp_rank"])
    lay = Layout(padded_length=n, original_length=int(j["original_length"]),
                 cu_seqlens=tuple(cu), rank_tokens=tuple(tuple(int(t) for t in r["tokens"])
                                                       for r in ranks))
    if len(_LAYOUT_CACHE) > 4096:
        _LAYOUT_CACHE.clear()
    _LAYOUT_CACHE[key] = lay
    return lay


@dataclasses.dataclass(frozen=True)
class Supports:
    """What an implementation supports; scenarios outside it are not drawn (skipped, not
    failed). Every field defaults to "supported"."""
    ulysses: bool = True                 # ulysses > 1
    ring: bool = True                    # ring > 1
    hybrid: bool = True                  # ulysses > 1 and ring > 1 together
    layouts: tuple = LAYOUTS             # ring layouts
    dtypes: tuple = DTYPES
    gqa: bool = True                     # kv_heads < heads
    kv_heads_below_ulysses: bool = True  # kv_heads < ulysses (KV heads repeated)
    odd_head_dim: bool = True
    padding: bool = True                 # rows whose length needs SP padding
    multiple_docs: bool = True           # more than one document per row
    max_ulysses: int = 64
    max_ring: int = 64
    profiles: tuple = ("xorl",)          # whose data path lays out the row
    backward: bool = True                # False: forward only (no backward run, no gradient
                                         # judged), for code whose backward cannot run here
    # The attention options (docs/attention.md): each True key draws it (off by default, so an
    # implementation is asked only for what it declares); causal False draws no causal mask.
    causal: bool = True                  # causal masks
    bidirectional: bool = False          # no causal mask (diffusion transformers)
    window: bool = False                 # sliding windows (ctx.window_size, ctx.sliding_window)
    chunk: bool = False                  # chunked attention (ctx.chunk)
    sinks: bool = False                  # a sink logit per query head (ctx.sinks, its gradient)
    softcap: bool = False                # logit soft-capping (ctx.softcap)

    @staticmethod
    def of(x):
        if x is None:
            return Supports()
        if isinstance(x, Supports):
            return x
        if isinstance(x, dict):
            known = {f.name for f in dataclasses.fields(Supports)}
            bad = sorted(set(x) - known)
            if bad:
                raise ValueError("supports=%s: unknown keys %s; known: %s" % (x, bad,
                                                                             sorted(known)))
            d = dict(x)
            for k in ("layouts", "dtypes", "profiles"):
                if k in d and isinstance(d[k], str):
                    d[k] = (d[k],)
                if k in d:
                    d[k] = tuple(d[k])
            for k, allowed in (("layouts", LAYOUTS), ("dtypes", DTYPES), ("profiles", PROFILES)):
                if k in d and not set(d[k]) <= set(allowed):
                    raise ValueError("supports[%r]=%s: each must be one of %s" % (k, d[k],
                                                                                allowed))
            return Supports(**d)
        raise TypeError("supports= takes a dict or seqpar.testing.Supports, not %r" % (x,))

    def admits(self, scn, padded_length=None):
        """None when scn is inside what is supported, else the reason it is not."""
        U, R = scn.ulysses, scn.ring
        checks = [
            (U > 1 and not self.ulysses, "ulysses > 1"),
            (R > 1 and not self.ring, "ring > 1"),
            (U > 1 and R > 1 and not self.hybrid, "hybrid ulysses × ring"),
            (U > self.max_ulysses, "ulysses > %d" % self.max_ulysses),
            (R > self.max_ring, "ring > %d" % self.max_ring),
            (R > 1 and scn.layout not in self.layouts, "layout %s" % scn.layout),
            (scn.dtype not in self.dtypes, "dtype %s" % scn.dtype),
            (scn.kv_heads < scn.heads and not self.gqa, "GQA"),
            (scn.kv_heads < U and not self.kv_heads_below_ulysses, "kv_heads < ulysses"),
            (scn.head_dim % 2 == 1 and not self.odd_head_dim, "odd head_dim"),
            (len(scn.docs) > 1 and not self.multiple_docs, "several documents"),
            (scn.profile not in self.profiles, "profile %s" % scn.profile),
            (padded_length is not None and padded_length != scn.tokens and not self.padding,
             "SP padding"),
            (scn.causal and not self.causal, "a causal mask"),
            (not scn.causal and not self.bidirectional, "bidirectional attention"),
            (scn.window_back >= 0 and not self.window, "a sliding window"),
            (scn.chunk > 0 and not self.chunk, "chunked attention"),
            (scn.sinks and not self.sinks, "attention sinks"),
            (scn.softcap > 0 and not self.softcap, "soft-capping"),
        ]
        for bad, what in checks:
            if bad:
                return what
        return None


def _factorisations(max_world, sup):
    """(U, R) pairs with U·R ≤ max_world, simplest first (Hypothesis shrinks toward the front)."""
    out = []
    for w in range(1, max_world + 1):
        for R in range(1, w + 1):
            if w % R:
                continue
            U = w // R
            if U > 1 and not sup.ulysses or R > 1 and not sup.ring:
                continue
            if U > 1 and R > 1 and not sup.hybrid:
                continue
            if U > sup.max_ulysses or R > sup.max_ring:
                continue
            out.append((U, R))
    # world 2 first: the smallest world where SP happens; then by world, Ulysses before ring.
    out.sort(key=lambda ur: (ur[0] * ur[1] == 1, ur[0] * ur[1], ur[1]))
    return out


def _weighted(facts, sup):
    """`facts` with the layouts whose Ulysses degree is composite listed again at the end, so
    that they make about a third of the draws. Only there can a rank hold several KV heads that
    are each repeated (1 < Hkv < U: U 4 at world 4), the one case where a blockwise repetition
    of the KV heads differs from the interleaved one that GQA needs. Drawn uniformly, U 4 was
    one layout of eight at world 4, and the case came first at example 156 of the property's
    own seed 0 (1-11 % of draws, bench/budgets.py). Hypothesis shrinks toward the front of the
    list, where every layout still stands once in its order."""
    if not sup.kv_heads_below_ulysses:
        return facts
    composite = [ur for ur in facts if any(ur[0] % m == 0 for m in range(2, ur[0]))]
    if not composite:
        return facts
    copies = -(-(len(facts) - 3 * len(composite)) // (2 * len(composite)))
    return facts + composite * max(0, copies)


def scenarios(max_world=4, supports=None, max_tokens=64, profile=None):
    """A Hypothesis strategy of Scenario inside `supports`, world ≤ max_world, at most
    max_tokens tokens before padding. Shrinks toward world 2, few short documents, small heads,
    head_dim 4, f32, seed 0."""
    from hypothesis import strategies as st

    sup = Supports.of(supports)
    facts = _factorisations(max_world, sup)
    if not facts:
        raise ValueError("supports=%s with max_world=%d leaves no ulysses × ring layout to draw"
                         % (sup, max_world))
    dtypes = [d for d in DTYPES if d in sup.dtypes]
    if not dtypes:
        raise ValueError("supports.dtypes=%s leaves no dtype to draw" % (sup.dtypes,))
    profiles = [p for p in PROFILES if p in sup.profiles] if profile is None else [profile]
    masks = [True] * sup.causal + [False] * sup.bidirectional  # causal first: it shrinks there
    if not masks:
        raise ValueError("supports=%s draws neither causal nor bidirectional attention" % (sup,))

    # The layouts each profile can lay out (rings: xorl only), weighted once here.
    layouts_of = {p: _weighted([(U, R) for U, R in facts if R == 1 or p == "xorl"], sup)
                  for p in profiles}

    @st.composite
    def draw(d):
        prof = d(st.sampled_from(profiles))
        pf = layouts_of[prof]
        if not pf:
            from hypothesis import reject
            reject()
        U, R = d(st.sampled_from(pf))
        lay = "zigzag"
        if R > 1:
            lay = d(st.sampled_from([x for x in LAYOUTS if x in sup.layouts]))
        # KV heads: Hkv = U/m (m | U, repeated when below U) or U·m; then H = Hkv·g with H % U
        # == 0. VeOmni also needs Hkv % U == 0 when U ≤ Hkv, which U·m gives.
        kv_opts = sorted({U // m for m in range(1, U + 1) if U % m == 0} |
                         {U * m for m in (1, 2)})
        if not sup.kv_heads_below_ulysses:
            kv_opts = [h for h in kv_opts if h >= U]
        kv_opts.sort(key=lambda h: (h != max(1, U // 2) if U > 1 else h != 1, h))
        # Several KV heads, each repeated on a rank, listed twice (see _weighted).
        kv_opts += [h for h in kv_opts if 1 < h < U]
        Hkv = d(st.sampled_from(kv_opts))
        rep = U // Hkv if U > Hkv else 1
        g_opts = [rep * m for m in (1, 2, 3)]
        if sup.gqa:
            g_opts = [g for g in g_opts if g > 1] + [g for g in g_opts if g == 1]
        else:
            g_opts = [1] if rep == 1 else []
        if not g_opts:
            from hypothesis import reject
            reject()
        H = Hkv * d(st.sampled_from(g_opts))
        dims = [4, 8, 3, 5, 16, 2, 7, 32]
        if not sup.odd_head_dim:
            dims = [x for x in dims if x % 2 == 0]
        D = d(st.sampled_from(dims))
        unit = 2 * R if (R > 1 and lay == "zigzag") else 1
        if not sup.padding:
            # Code that takes no SP padding is given rows that need none: every document a
            # multiple of the whole world's split (U·2R: seqpar cuts a ring's row into 2R
            # chunks in either layout). Drawn freely, most rows with U > 1 needed padding and
            # were refused: in yunchang's space 13 of the first 40 draws, and a mistake in the
            # Ulysses all-to-all first failed at example 27-51 (bench/budgets.py).
            unit = U * (2 * R if R > 1 else 1)
        max_docs = 4 if sup.multiple_docs else 1
        budget = max(unit, max_tokens)
        n_docs = d(st.integers(1, max_docs))
        docs = []
        for i in range(n_docs):
            left = budget - sum(docs)
            if left < unit:
                break
            c = d(st.integers(1, max(1, min(left // unit, 24 // unit if unit <= 24 else 1))))
            docs.append(c * unit)
        if prof == "deepspeed" and sum(docs) % U:
            docs[-1] += U - sum(docs) % U  # DeepSpeed's adapter needs rows divisible by U
        dtype = d(st.sampled_from(dtypes))
        q_scale = d(st.sampled_from([1.0, 4.0, 16.0, 64.0]))
        seed = d(st.integers(0, 2 ** 16))
        # The attention options, each shrinking to off (causal, no window, no chunk, no sinks,
        # no capping): windows and chunks of widths around the documents' lengths (1 … the
        # longest + 1: shorter than, equal to and longer than a document).
        opts = dict(causal=masks[0] if len(masks) == 1 else d(st.sampled_from(masks)))
        longest = max(docs)
        if sup.window and d(st.booleans()):
            w = d(st.integers(1, longest + 1))
            if opts["causal"]:
                opts["window_back"] = w - 1  # transformers' sliding_window w: w keys, its own too
            else:
                opts["window_back"] = w
                opts["window_ahead"] = d(st.integers(0, w))
        if sup.chunk and d(st.booleans()):
            opts["chunk"] = d(st.integers(1, longest + 1))
        if sup.sinks:
            opts["sinks"] = d(st.booleans())
        if sup.softcap:
            opts["softcap"] = d(st.sampled_from([0.0, 2.0, 0.5]))
        return Scenario(ulysses=U, ring=R, layout=lay, heads=H, kv_heads=Hkv, head_dim=D,
                        docs=tuple(docs), dtype=dtype, seed=seed, q_scale=q_scale, profile=prof,
                        **opts)

    return draw()
