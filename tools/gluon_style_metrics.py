"""Style metrics of the Gluon Hopper kernels (issue 60): the longest @gluon.jit function (lines and
parameters), constexprs passed by position and by keyword, placeholder aliases, ``if PERSISTENT``.

    python tools/gluon_style_metrics.py                       # kernels/hopper_*.py of this checkout
    python tools/gluon_style_metrics.py --root /tmp/old_checkout

A constexpr is a parameter annotated ``gl.constexpr`` of a @gluon.jit function (or method) defined
in the files measured; a call counts when its callee's name resolves to one of them.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import sys


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _constexpr_params(fn: ast.FunctionDef) -> list[bool]:
    return [a.annotation is not None and "constexpr" in ast.unparse(a.annotation) for a in fn.args.args]


def measure(paths):
    funcs = {}  # name -> (is_method, [constexpr flags])
    rows = []
    trees = {}
    for path in paths:
        tree = ast.parse(open(path).read())
        trees[path] = tree
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        item._method = True  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                method = getattr(node, "_method", False)
                flags = _constexpr_params(node)
                funcs[node.name] = (method, flags)
                n_params = len(node.args.args) - (1 if method else 0)
                lines = node.end_lineno - node.lineno + 1
                rows.append((os.path.basename(path), node.name, lines, n_params, sum(flags)))
    positional = keyword = 0
    for tree in trees.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else (
                node.func.attr if isinstance(node.func, ast.Attribute) else None)
            if name not in funcs:
                continue
            method, flags = funcs[name]
            offset = 1 if method else 0
            for i, _ in enumerate(node.args):
                if i + offset < len(flags) and flags[i + offset]:
                    positional += 1
            for kw in node.keywords:
                keyword += 1 if kw.arg is not None else 0
    return rows, positional, keyword


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ap.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.root, "flash_inductor", "kernels", "hopper_*.py")))
    rows, positional, keyword = measure(paths)
    longest = max(rows, key=lambda r: r[2])
    most = max(rows, key=lambda r: r[3])
    text = {p: open(p).read() for p in paths}
    placeholders = sum(len(re.findall(r"#\s*(unused|not read)\b", t)) for t in text.values())
    if_persistent = sum(len(re.findall(r"\bif (not )?(cfg\.|self\.cfg\.)?PERSISTENT\b", t)) for t in text.values())
    for path in paths:
        print(f"{os.path.basename(path)}: {len(text[path].splitlines())} lines")
    print(f"longest function: {longest[1]} ({longest[0]}) {longest[2]} lines, {longest[3]} parameters")
    print(f"most parameters: {most[1]} ({most[0]}) {most[3]} parameters ({most[4]} constexpr), {most[2]} lines")
    over = [r for r in rows if r[2] > 80 or r[3] > 20]
    print("over 80 lines or 20 parameters:", ", ".join(f"{r[1]} ({r[2]} lines, {r[3]} params)" for r in over)
          or "none")
    print(f"keyword arguments at calls of these functions: {keyword}")
    print(f"constexprs passed by position: {positional}")
    print(f"placeholder aliases ('# unused' / '# not read'): {placeholders}")
    print(f"'if PERSISTENT' (also cfg./self.cfg., 'if not'): {if_persistent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
