"""Mutants made by rule (bench/mutate.py --generated): the places where promises live are
declared in bench/mutants/places.json, and every mutant of them is derived mechanically:

  table     every row of a mapping table ({key, value} pairs, `case K: return V;`): its value
            replaced by the nearest row's different value (a neighbour in the table)
  constant  every numeric literal but 0 and the integer 1: × 2 and ÷ 2 (two mutants)
  compare   every comparison `a < b`, `<=`, `>`, `>=`: its strictness flipped (< ↔ ≤, > ↔ ≥)
  draw      every Hypothesis draw d(st.integers(a, b)) / d(st.sampled_from([...])) /
            d(st.booleans()): collapsed to one end (a and b; the first item; False and True)
  uniform   every torch.rand/randn(size…, keywords): one value repeated over the size
  family    every member of a family list: dropped — each element of a range-for's braced list
            (`for (double c : {2.0, 0.5, …})`) and each statement that starts with the place's
            "entry" text (like `members.push_back(`)

A place is {"area", "file", "from", "to", "rules", "tests", ["entry"]}: the rules apply to the
text between the first occurrence of "from" and the next occurrence of "to" after it (both
exact; "from" once in the file). Comments and string literals are not mutated (table rows, which
hold strings, are). Each mutant's "find" is its line(s), grown by whole lines until it occurs
once in the file, so bench/mutate.py applies it exactly as generated. Mutant ids are
<area>.<rule>.<what>[.<n>], stable while the code of the place keeps its text.

places.json's "equivalent" maps a mutant id to the reason it cannot be killed (it changes
nothing observable); "survivors" maps a mutant id that no test kills yet to what is missing.
Both are listed, not run (so that CI's random draw fails only on a new survivor).
"""
import json
import os
import re


def code_mask(text, python=False):
    """Per character: 'c' code, 's' inside a string literal, '#' inside a comment."""
    mask = ["c"] * len(text)
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if python and ch == "#" or not python and text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            mask[i:j] = "#" * (j - i)
            i = j
        elif not python and text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            mask[i:j] = "#" * (j - i)
            i = j
        elif ch in "\"'":
            if not python and ch == "'" and i > 0 and (text[i - 1].isalnum()):
                i += 1  # a digit separator (1'000) or a suffix: not a quote
                continue
            quote = text[i:i + 3] if python and text[i:i + 3] in ('"""', "'''") else ch
            j = i + len(quote)
            while j < n and not text.startswith(quote, j):
                j += 2 if text[j] == "\\" else 1
            j = min(n, j + len(quote))
            mask[i:j] = "s" * (j - i)
            i = j
        else:
            i += 1
    return "".join(mask)


def _line_span(text, start, end):
    a = text.rfind("\n", 0, start) + 1
    b = text.find("\n", end)
    return a, (len(text) if b < 0 else b)


def _unique_find(text, start, end, replacement):
    """(find, replace): the lines holding text[start:end], grown by lines until unique."""
    a, b = _line_span(text, start, end)
    while True:
        find = text[a:b]
        if text.count(find) == 1:
            return find, text[a:start] + replacement + text[end:b]
        if a == 0 and b == len(text):
            raise ValueError("cannot make a unique find")
        a = text.rfind("\n", 0, max(a - 1, 0)) + 1 if a > 0 else 0
        nb = text.find("\n", b + 1)
        b = len(text) if nb < 0 else nb


NUMBER = re.compile(r"(?<![\w.])(\d+\.\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+)"
                    r"([fFuUlL]*)(?![\w.])")
COMPARE = re.compile(r"(?<=[\w)\]] )(<=|>=|<|>)(?= [\w(!\-.:*&\"'])")
TABLE_ROW = re.compile(r"\{\s*(\"[^\"]*\"|-?[\w:.]+)\s*,\s*(\"[^\"]*\"|-?[\w:.]+)\s*\}")
CASE_ROW = re.compile(r"case\s+([^:]+?)\s*:\s*return\s+([^;]+);")
PY_DICT_ROW = re.compile(r"(\"[^\"]*\"|'[^']*'|-?\d+)\s*:\s*(\"[^\"]*\"|'[^']*'|-?\d+)")
RANGE_FOR = re.compile(r"for \([^:;()]*[\w&] : \{")
DRAW = re.compile(r"(\w+\()st\.(integers|sampled_from|booleans)\(")
TORCH_RAND = re.compile(r"(torch\.randn?)\(")


def _fmt_number(value, literal, suffix):
    if re.fullmatch(r"\d+", literal):
        return f"{int(value)}{suffix}"
    if "e" in literal.lower():
        mant, exp = f"{float(value):.15e}".split("e")
        mant = mant.rstrip("0").rstrip(".")
        return f"{mant}e{int(exp)}{suffix}"
    s = repr(float(value))
    return s + suffix


def _slug(s):
    return re.sub(r"[^A-Za-z0-9_+\-]+", "_", s).strip("_")[:40] or "x"


def _split_top(inner):
    """(start, end) spans of inner's top-level comma-separated parts."""
    parts, depth, last = [], 0, 0
    for k, ch in enumerate(inner):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append((last, k))
            last = k + 1
    parts.append((last, len(inner)))
    return parts


def _matching(text, open_at, opener="(", closer=")"):
    depth = 0
    for k in range(open_at, len(text)):
        if text[k] == opener:
            depth += 1
        elif text[k] == closer:
            depth -= 1
            if depth == 0:
                return k
    raise ValueError("unbalanced")


def place_mutants(root, place):
    path = os.path.join(root, place["file"])
    text = open(path).read()
    python = path.endswith(".py")
    if text.count(place["from"]) != 1:
        raise ValueError(f"{place['area']}: 'from' occurs {text.count(place['from'])} times in "
                         f"{place['file']} (want once): {place['from']!r}")
    lo = text.index(place["from"])
    hi = text.find(place["to"], lo + len(place["from"]))
    if hi < 0:
        raise ValueError(f"{place['area']}: 'to' not found after 'from' in {place['file']}: "
                         f"{place['to']!r}")
    hi += len(place["to"])
    mask = code_mask(text, python)
    out, seen = [], {}

    def add(rule, what, start, end, repl, promise):
        base = f"{place['area']}.{rule}.{_slug(what)}"
        seen[base] = seen.get(base, 0) + 1
        mid = base if seen[base] == 1 else f"{base}.{seen[base]}"
        find, replace = _unique_find(text, start, end, repl)
        out.append({"id": mid, "promise": promise, "file": place["file"], "find": find,
                    "replace": replace, "tests": place["tests"], "rule": rule,
                    "line": text.count("\n", 0, start) + 1, "generated": True})

    rules = place["rules"]
    region = text[lo:hi]
    if "table" in rules:
        rows = []
        for rx in ((PY_DICT_ROW,) if python else (TABLE_ROW, CASE_ROW)):
            for m in rx.finditer(region):
                s = lo + m.start()
                if mask[s] == "#":
                    continue
                rows.append((s, m))
        rows.sort(key=lambda r: r[0])
        for k, (s, m) in enumerate(rows):
            value = m.group(2)
            # the nearest row (after, then before) whose value differs
            order = [j for d in range(1, len(rows)) for j in (k + d, k - d) if 0 <= j < len(rows)]
            other = next((rows[j][1].group(2) for j in order if rows[j][1].group(2) != value), None)
            if other is None:
                continue
            vs = s + m.start(2) - m.start()
            add("table", m.group(1).strip("\"'"), vs, vs + len(value), other,
                f"the table row {m.group(1)} → {value} (replaced by {other})")
    if "constant" in rules:
        for m in NUMBER.finditer(region):
            s = lo + m.start()
            if mask[s] != "c":
                continue
            lit, suffix = m.group(1), m.group(2)
            v = float(lit)
            if v == 0 or (v == 1 and re.fullmatch(r"\d+", lit)):
                continue
            line_start = text.rfind("\n", 0, s) + 1
            if text[line_start:s].lstrip().startswith("#"):
                continue  # a preprocessor line
            for tag, nv in (("x2", v * 2), ("div2", v / 2)):
                if re.fullmatch(r"\d+", lit) and tag == "div2" and int(v) % 2:
                    nv = int(v) // 2
                    if nv <= 1:
                        continue
                add("constant", f"{lit}.{tag}", s, s + len(lit) + len(suffix),
                    _fmt_number(nv, lit, suffix), f"the constant {lit} ({tag.replace('div', '÷').replace('x', '×')})")
    if "compare" in rules:
        flip = {"<": "<=", "<=": "<", ">": ">=", ">=": ">"}
        for m in COMPARE.finditer(region):
            s = lo + m.start()
            if mask[s] != "c":
                continue
            line_start, line_end = _line_span(text, s, s)
            if text[line_start:s].lstrip().startswith(("#", "template", "//")):
                continue
            op = m.group(1)
            ctx = text[max(line_start, s - 24):s].strip().split()[-1] if text[line_start:s].strip() else ""
            add("compare", f"{ctx}{op}", s, s + len(op), flip[op],
                f"the comparison `{text[line_start:line_end].strip()}` ({op} → {flip[op]})")
    if "family" in rules:
        for m in RANGE_FOR.finditer(region):
            ob = lo + m.end() - 1
            if mask[ob] != "c":
                continue
            cb = _matching(text, ob, "{", "}")
            inner = text[ob + 1:cb]
            parts = _split_top(inner)
            if len(parts) < 2:
                continue
            for k, (a, b) in enumerate(parts):
                kept = [inner[x:y].strip() for j, (x, y) in enumerate(parts) if j != k]
                add("family", f"drop_{inner[a:b].strip()}", ob + 1, cb, ", ".join(kept),
                    f"the family member {inner[a:b].strip()} of {{{inner.strip()}}} (dropped)")
        entry = place.get("entry")
        if entry:
            for m in re.finditer(re.escape(entry), region):
                s = lo + m.start()
                if mask[s] != "c":
                    continue
                op = s + len(entry) - 1 if entry.endswith("(") else text.index("(", s)
                close = _matching(text, op)
                end = close + 1
                if end < len(text) and text[end] == ";":
                    end += 1
                what = re.sub(r"\s+", " ", text[op + 1:op + 60])
                add("family", f"drop_{what[:30]}", s, end, ";" if not python else "pass",
                    f"the family member `{what.strip()}…` (dropped)")
    def calls(rx):
        """Per match of rx (ending at a call's opening parenthesis) in the place's code: the
        match, its start, the call's closing parenthesis, its argument text and top-level
        arguments."""
        for m in rx.finditer(region):
            s = lo + m.start()
            if mask[s] != "c":
                continue
            op = s + m.end() - m.start() - 1
            close = _matching(text, op)
            args = text[op + 1:close]
            yield m, s, close, args, [args[a:b].strip() for a, b in _split_top(args)]

    if "draw" in rules:
        # Every Hypothesis draw d(st.KIND(ARGS)) collapsed to one of its ends: a draw whose
        # variety no test relies on survives.
        for m, s, close, args, spans in calls(DRAW):
            end = _matching(text, s + len(m.group(1)) - 1) + 1  # the d(...) call
            kind = m.group(2)
            if kind == "integers" and len(spans) == 2:
                ends = [("low", spans[0]), ("high", spans[1])]
            elif kind == "sampled_from" and spans[0].startswith("["):
                items = [x.strip() for x in (spans[0][1:-1].split(",") if spans[0][1:-1] else [])]
                ends = [("first", items[0])] if items else []
            elif kind == "booleans":
                ends = [("false", "False"), ("true", "True")]
            else:
                ends = []
            code = text[s:end]
            for tag, value in ends:
                add("draw", f"{kind}_{tag}_{args[:24]}", s, end, value,
                    f"the draw `{code}` collapsed to {value} ({tag})")
    if "uniform" in rules:
        # Every torch.rand/randn(SIZE…, keywords) made one value repeated over SIZE: a draw
        # whose elements must differ (one per head) that no test tells from a constant survives.
        for m, s, close, args, spans in calls(TORCH_RAND):
            size = [x for x in spans if "=" not in x]
            kw = [x for x in spans if "=" in x]
            if not size:
                continue
            repl = "%s(%s).repeat(%s)" % (m.group(1), ", ".join(["1"] + kw), ", ".join(size))
            add("uniform", f"{m.group(1)}_{size[0]}", s, close + 1, repl,
                f"the random `{text[s:close + 1]}` made one value repeated over its size")
    return out


def generate(root, places_path):
    with open(places_path) as f:
        spec = json.load(f)
    mutants = []
    for place in spec["places"]:
        mutants.extend(place_mutants(root, place))
    ids = [m["id"] for m in mutants]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise ValueError(f"generated ids repeat (two places with one area?): {sorted(dup)}")
    equivalent = spec.get("equivalent", {})
    survivors = spec.get("survivors", {})
    stale = sorted((set(equivalent) | set(survivors)) - set(ids))
    for m in mutants:
        if m["id"] in equivalent:
            m["equivalent"] = equivalent[m["id"]]
        if m["id"] in survivors:
            m["known_survivor"] = survivors[m["id"]]
    return mutants, stale
