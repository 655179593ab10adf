"""Normalised sm_90a SASS of the Gluon Hopper kernels, one file per config, so that a refactor of
kernels/hopper_*.py can be shown to leave the compiled code unchanged (no GPU needed).

    python tools/sass_baseline.py --out /tmp/sass_before            # on the commit before the edit
    (edit the kernels)
    python tools/sass_baseline.py --out /tmp/sass_after --compare /tmp/sass_before

The configs are every distinct Gluon config of the shipped tuning tables (tuning/tables/*.json:
the roles ``gluon_forward``, ``gluon_forward_exact``, ``gluon_backward``), each in fp16 and bf16,
plus the features the tables do not exercise: a window's left side, block sparsity, a key bias,
the persistent and grid forward, SKIP_MASKED_TILES, the backward's GQA split, ragged L, atomics
for dQ and LSE/Δ loads from global memory. Each SASS is written with addresses and encodings
stripped (the instruction text only, ``<tag>.sass``), and the PTX without its debug information
(``<tag>.ptx``). ``--compare`` reports per config whether the SASS is byte-identical, identical up
to register numbers (``R12`` -> ``R``, ``.reuse`` flags) with the PTX code identical, or
different (with the instruction counts), and exits 1 if any is different.

Why the PTX: Triton compiles with line information, and the PTX then carries a ``$L__tmpN:`` label
at each edge of an inlined call's range (for the DWARF tables). ptxas treats those labels as
places code may branch to, so a helper split out of a function (a new inlined call) can permute
the register numbers ptxas picks, or the order it schedules instructions in, while the code is
the same. Where the PTX code is
identical with the debug information removed, the kernels compute the same: compiled without line
information, the SASS is byte-identical (ptxas is deterministic). Uses Triton's bundled
ptxas/cuobjdump through tools/hopper_{fwd,bwd}_compile.py.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_configs():
    """(kind, kwargs) of every distinct Gluon config in the shipped tables, fp16 and bf16 each."""
    seen = []
    for path in sorted(glob.glob(os.path.join(_ROOT, "flash_inductor", "tuning", "tables", "*.json"))):
        with open(path) as f:
            entries = json.load(f)["entries"]
        for key, entry in entries.items():
            schedule, _dtype, e, mask = key.split("/")[:4]
            for role, c in entry["configs"].items():
                e_ = int(e[1:])
                causal = mask == "causal"
                for dtype in ("fp16", "bf16"):
                    if role in ("gluon_forward", "gluon_forward_exact"):
                        kw = dict(head_dim=e_, dtype=dtype, causal=causal, block_m=c.get("block_m", 64),
                                  block_n=c["block_n"], stages=c["num_stages"], consumers=c["num_consumers"],
                                  pingpong=c["pingpong"], persistent=c.get("persistent", False),
                                  exact_delta=role == "gluon_forward_exact")
                        item = ("fwd", kw)
                    elif role == "gluon_backward":
                        exact = schedule == "stable"
                        kw = dict(head_dim=e_, dtype=dtype, causal=causal, block_m=c.get("block_m", 64),
                                  stages=c["num_stages"], dq_split=c["dq_split"], dq_tma=c["dq_tma"],
                                  row_stats_tma=c["row_stats_tma"], paired_tiles=c["paired_tiles"],
                                  exact_delta=exact, centre_keys=exact)
                        item = ("bwd", kw)
                    else:
                        continue
                    if item not in seen:
                        seen.append(item)
    return seen


def extra_configs():
    """Features the tables do not cover, around the tables' most common configs."""
    f128 = dict(head_dim=128, block_n=128, stages=2, consumers=2, pingpong=True)
    f64 = dict(head_dim=64, block_n=128, stages=3, consumers=3, pingpong=True)
    out = []
    for dtype in ("fp16", "bf16"):
        for base in (f128, f64):
            for extra in (dict(causal=False), dict(causal=True), dict(causal=True, window=True),
                          dict(causal=False, key_bias=True), dict(causal=True, exact_delta=True, key_bias=True),
                          dict(causal=True, block_sparse=True, persistent=True),
                          dict(causal=False, block_sparse=True, persistent=False),
                          dict(causal=True, window=True, persistent=True, exact_delta=True),
                          dict(causal=True, skip_masked_tiles=True), dict(causal=True, window=True, skip_masked_tiles=True),
                          dict(causal=True, skip_masked_tiles=True, persistent=True, exact_delta=True)):
                out.append(("fwd", dict(base, dtype=dtype, **extra)))
        for e, split in ((128, True), (64, False)):
            base = dict(head_dim=e, dtype=dtype, stages=2, dq_split=split, dq_tma=True)
            for extra in (dict(causal=True), dict(causal=False, exact_delta=True, centre_keys=True),
                          dict(causal=True, window=True), dict(causal=True, key_bias=True, exact_delta=True, centre_keys=True),
                          dict(causal=False, group_split=2), dict(causal=True, block_sparse=True),
                          dict(causal=True, even_l=False), dict(causal=False, dq_tma=False),
                          dict(causal=True, row_stats_tma=False), dict(causal=True, paired_tiles=True),
                          dict(causal=True, paired_tiles=True, block_sparse=True, exact_delta=True, centre_keys=True)):
                out.append(("bwd", dict(base, **extra)))
    return out


def all_configs():
    seen = []
    for item in table_configs() + extra_configs():
        if item not in seen:
            seen.append(item)
    return seen


def tag_of(kind, kw) -> str:
    return kind + "_" + "_".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(kw.items()))


_ADDR = re.compile(r"/\*[0-9a-f]{4,}\*/")
_ENC = re.compile(r"/\* 0x[0-9a-f]+ \*/")


def normalise(sass: str) -> str:
    """The instruction text: addresses, encodings, blank and header lines dropped."""
    lines = []
    for line in sass.splitlines():
        if not _ADDR.search(line):
            if line.strip().startswith(("Function", ".")):
                lines.append(line.strip())
            continue
        text = _ENC.sub("", _ADDR.sub("", line)).strip()
        if text:
            lines.append(" ".join(text.split()))
    return "\n".join(lines) + "\n"


_DEBUG_LINE = re.compile(r"^\s*(//|\.loc\b|\.file\b|\$L__tmp\d+:)")


def ptx_code(ptx: str) -> str:
    """The PTX without its debug information: the DWARF sections, line directives and the
    ``$L__tmpN:`` labels that mark inlined calls' ranges (see ``main``)."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(line.split("//")[0].rstrip() for line in code.splitlines()
                     if line.strip() and not _DEBUG_LINE.match(line)) + "\n"


def register_free(norm: str) -> str:
    return re.sub(r"\bU?R\d+\b|\bU?P\d\b", "R", norm).replace(".reuse", "")


def compile_one(item):
    kind, kw = item
    if kind == "fwd":
        tool = _load("hopper_fwd_compile")
        kw = dict(kw)
        k = tool.compile_config(kw.pop("head_dim"), kw.pop("dtype"), kw.pop("causal"), kw.pop("block_m", 64),
                                kw.pop("block_n"), kw.pop("stages"), **kw)
    else:
        tool = _load("hopper_bwd_compile")
        kw = dict(kw)
        k = tool.compile_config(kw.pop("head_dim"), kw.pop("dtype"), kw.pop("causal"), **kw)
    return normalise(_load("hopper_fwd_compile").sass_of(k)), ptx_code(k.asm["ptx"])


def _work(args):
    item, out = args
    tag = tag_of(*item)
    try:
        text, ptx = compile_one(item)
    except Exception as exc:  # a config that does not compile is reported, not fatal
        text = ptx = f"COMPILE ERROR: {type(exc).__name__}: {exc}\n"
    with open(os.path.join(out, tag + ".sass"), "w") as f:
        f.write(text)
    with open(os.path.join(out, tag + ".ptx"), "w") as f:
        f.write(ptx)
    return tag, hashlib.sha256(text.encode()).hexdigest()[:16], len(text.splitlines())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", default=None, help="a folder an earlier run wrote")
    ap.add_argument("-j", type=int, default=2)
    ap.add_argument("--only", default="", help="regex of the config tags to compile (e.g. ^fwd_)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    items = [it for it in all_configs() if re.search(args.only, tag_of(*it))]
    if args.list:
        for it in items:
            print(tag_of(*it))
        print(len(items), "configs")
        return 0
    os.makedirs(args.out, exist_ok=True)
    with ProcessPoolExecutor(args.j) as pool:
        results = list(pool.map(_work, [(it, args.out) for it in items]))
    with open(os.path.join(args.out, "digests.json"), "w") as f:
        json.dump({tag: digest for tag, digest, _ in results}, f, indent=1, sort_keys=True)
    bad = 0
    for tag, digest, n in results:
        line = f"{digest} {n:6d} {tag}"
        if args.compare:
            old_path = os.path.join(args.compare, tag + ".sass")
            new = open(os.path.join(args.out, tag + ".sass")).read()
            if not os.path.exists(old_path):
                verdict = "NEW"
            else:
                old = open(old_path).read()
                ptx_path = os.path.join(args.compare, tag + ".ptx")
                same_ptx = os.path.exists(ptx_path) and (
                    open(ptx_path).read() == open(os.path.join(args.out, tag + ".ptx")).read())
                if old == new:
                    verdict = "identical"
                elif register_free(old) == register_free(new):
                    verdict = "registers-only, PTX code identical" if same_ptx else "registers-only"
                elif same_ptx:
                    verdict = "PTX code identical, SASS order differs"
                else:
                    verdict = f"DIFFERENT ({len(old.splitlines())} -> {len(new.splitlines())} instructions)"
            bad += not verdict.startswith(("identical", "registers-only, PTX", "PTX code identical"))
            line = f"{verdict:40s} {line}"
        print(line, flush=True)
    if args.compare:
        print(f"{len(results) - bad}/{len(results)} with byte-identical SASS or identical PTX code")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
