"""The Gluon Hopper kernels' readability rules (issue 60), held by CI: no @gluon.jit function over 80
lines or 20 parameters, no constexpr passed by position, no placeholder alias ("# unused" / "# not
read") in ``flash_inductor/kernels/hopper_*.py``. The rules read the source with ``ast``, so they
run anywhere; the synthetic kernels below show that each rule can fail."""

from __future__ import annotations

import ast
import pathlib
import re
import textwrap

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "flash_inductor" / "kernels"
MAX_LINES, MAX_PARAMS = 80, 20


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _methods(tree: ast.Module) -> set[int]:
    return {id(item) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            for item in node.body if isinstance(item, ast.FunctionDef)}


def measure(sources: dict[str, str]) -> dict:
    """Over the given files: every jit function's (file, name, lines, parameters), the constexpr
    arguments passed by position at calls of those functions (file, line, callee), and the
    placeholder comments."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    functions, constexpr_flags = [], {}
    for name, tree in trees.items():
        methods = _methods(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                skip = 1 if id(node) in methods else 0  # self
                params = node.args.args[skip:] + node.args.kwonlyargs
                functions.append((name, node.name, node.end_lineno - node.lineno + 1, len(params)))
                constexpr_flags[node.name] = [a.annotation is not None and "constexpr" in ast.unparse(a.annotation)
                                              for a in node.args.args[skip:]]
    positional = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            callee = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            flags = constexpr_flags.get(callee, [])
            positional += [(name, node.lineno, callee) for i, _ in enumerate(node.args) if i < len(flags) and flags[i]]
    placeholders = [(name, text.count("\n", 0, m.start()) + 1) for name, text in sources.items()
                    for m in re.finditer(r"#\s*(unused|not read)\b", text)]
    return dict(functions=functions, positional=positional, placeholders=placeholders)


def _hopper_sources() -> dict[str, str]:
    paths = sorted(KERNELS.glob("hopper_*.py"))
    assert paths, f"no kernels/hopper_*.py under {KERNELS}"
    return {p.name: p.read_text() for p in paths}


def test_hopper_kernels_keep_functions_short_and_constexprs_by_keyword():
    found = measure(_hopper_sources())
    too_big = [f for f in found["functions"] if f[2] > MAX_LINES or f[3] > MAX_PARAMS]
    assert not too_big, f"jit functions over {MAX_LINES} lines or {MAX_PARAMS} parameters: {too_big}"
    assert not found["positional"], f"constexprs passed by position (pass them by keyword): {found['positional']}"
    assert not found["placeholders"], f"placeholder aliases: {found['placeholders']}"
    assert len(found["functions"]) > 20, "the measure found too few kernel functions to be reading the kernels"


def test_each_rule_catches_its_violation():
    long_body = "\n".join(f"    x = x + {i}" for i in range(MAX_LINES))
    source = textwrap.dedent('''
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl

        @gluon.jit
        def tile(x, BLOCK: gl.constexpr):
            return x

        @gluon.jit
        def caller(x, BLOCK: gl.constexpr):
            y = 0  # unused
            return tile(x, BLOCK)
        ''') + "\n@gluon.jit\ndef long(x, " + ", ".join(f"a{i}" for i in range(MAX_PARAMS)) + "):\n" + long_body + \
        "\n    return x\n"
    found = measure({"synthetic.py": source})
    sizes = {name: (lines, params) for _, name, lines, params in found["functions"]}
    assert sizes["long"][0] > MAX_LINES and sizes["long"][1] > MAX_PARAMS
    assert found["positional"] == [("synthetic.py", 12, "tile")]
    assert found["placeholders"] == [("synthetic.py", 11)]
