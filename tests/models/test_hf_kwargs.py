"""Every keyword argument that the installed transformers' models pass to an attention function
is classified in ``flash_inductor.transformers.KWARG_ROLES`` (used, or ignored with the reason),
so the HF backend never drops one unawares; and an unknown one raises.

The scan reads ``models/*/modeling_*.py`` of the installed transformers (no model is imported):
the keywords of each attention-interface call (``attention_interface(...)``,
``ALL_ATTENTION_FUNCTIONS[...](...)``) and the keys of the typed dicts the calling forward's
``**kwargs`` are declared with (``Unpack[TransformersKwargs]``, ``FlashAttentionKwargs``,
``GraniteFlashAttentionKwargs``). Anything else that reaches the function through ``**kwargs``
is caught at run time: a name missing from the table raises unless its value is None.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

_INTERFACE = re.compile(r"ALL_ATTENTION_FUNCTIONS|attention_forward")


def _model_files():
    return sorted(pathlib.Path(transformers.__file__).parent.glob("models/*/modeling_*.py"))


def _typed_dict_keys(tree: ast.Module) -> dict[str, set[str]]:
    keys = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("TypedDict") for b in node.bases):
            keys[node.name] = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)
                               and isinstance(n.target, ast.Name)}
    return keys


def _interface_names(tree: ast.Module) -> set[str]:
    """Names bound to an attention function: ``attention_interface = ALL_ATTENTION_FUNCTIONS...``."""
    names = set()
    for node in ast.walk(tree):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is None or not _INTERFACE.search(ast.unparse(value)):
            continue
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
            if isinstance(target, (ast.Name, ast.Attribute)):
                names.add(target.id if isinstance(target, ast.Name) else target.attr)
    return names


def _passed_kwargs() -> dict[str, set[str]]:
    """{keyword: model files that pass it to an attention function}."""
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils.generic import TransformersKwargs

    typed = {"TransformersKwargs": set(TransformersKwargs.__annotations__),
             "FlashAttentionKwargs": set(FlashAttentionKwargs.__annotations__)}
    found: dict[str, set[str]] = {}
    for path in _model_files():
        tree = ast.parse(path.read_text())
        names, local_typed = _interface_names(tree), {**typed, **_typed_dict_keys(tree)}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"):
                calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
                interface = [c for c in calls if (isinstance(c.func, ast.Name) and c.func.id in names)
                             or (isinstance(c.func, ast.Attribute) and c.func.attr in names)
                             or (isinstance(c.func, ast.Subscript) and _INTERFACE.search(ast.unparse(c.func)))]
                for call in interface:
                    for kw in call.keywords:
                        if kw.arg is not None:
                            found.setdefault(kw.arg, set()).add(path.parent.name)
                    if fn.args.kwarg is not None and fn.args.kwarg.annotation is not None:
                        for td in re.findall(r"Unpack\[(\w+)\]", ast.unparse(fn.args.kwarg.annotation)):
                            for key in local_typed.get(td, ()):
                                found.setdefault(key, set()).add(path.parent.name)
    return found


def test_every_keyword_transformers_passes_is_classified():
    import flash_inductor.transformers as fit

    found = _passed_kwargs()
    assert {"dropout", "scaling", "cu_seq_lens_q", "s_aux", "softcap", "position_ids"} <= set(found), sorted(found)
    missing = {k: sorted(v)[:5] for k, v in found.items() if k not in fit.KWARG_ROLES}
    assert not missing, (f"transformers {transformers.__version__} passes keyword arguments to attention functions "
                         f"that KWARG_ROLES does not classify (name: some model files): {missing}")
    assert all(role in ("used", "ignored") and why for role, why in fit.KWARG_ROLES.values())


def test_an_unknown_keyword_raises_and_names_itself():
    import flash_inductor.transformers as fit

    q = torch.randn(1, 2, 4, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="brand_new_option"):
        fit.attention_forward(module, q, q, q, None, brand_new_option=torch.ones(1))
    # None is the absent value of every HF keyword: it cannot change the result.
    out, _ = fit.attention_forward(module, q, q, q, None, brand_new_option=None)
    assert out.shape == (1, 4, 2, 8)
