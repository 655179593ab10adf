"""HF generation with a static KV cache under our backend: the same tokens as eager, and every
attention site of the prefill and of the decode step rewritten.

A tiny Llama with GQA 8:1 (8 query heads, 1 KV head), and a Mistral with a sliding window shorter
than the generated length, run ``generate`` greedily with
``cache_implementation="static"``: each step writes its keys and values into the cache in place
(``StaticCache.update``'s ``index_copy_``) and attends over all ``max_cache_len`` slots, with a
mask hiding the slots not yet written. The model's forward is compiled with
``flash_inductor.backend`` (HF's documented pattern for a static cache; ``disable_compile`` keeps
``generate`` from compiling it a second time on a GPU). On CUDA the cache is long enough for the
decode steps to take the split-KV decode kernels (``launch/decode.py``); on CPU the op runs its
reference path, and Inductor's C++ code generation is skipped (``model_zoo.inductor_codegen_skipped``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import flash_inductor
from flash_inductor.launch.decode import DECODE_MIN_KEYS
from helpers import DEVICE, ON_CUDA
from model_zoo import inductor_codegen_skipped

pytestmark = [
    pytest.mark.usefixtures("fresh_compiler"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]

PROMPT, NEW_TOKENS = 5, 6
# On a GPU the decode steps' key length reaches the decode kernel's threshold; on CPU a short cache.
CACHE_LEN = 2 * DECODE_MIN_KEYS if ON_CUDA else 24


def _tiny_decoder(family: str, impl: str) -> torch.nn.Module:
    """Llama, or Mistral with a sliding window shorter than the generated length (its static cache
    layers then hold the window)."""
    import transformers as T

    torch.manual_seed(0)
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=1, vocab_size=64, max_position_embeddings=CACHE_LEN,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation=impl)
    if family == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**config, sliding_window=6)).to(DEVICE).eval()
    return T.LlamaForCausalLM(T.LlamaConfig(**config)).to(DEVICE).eval()


def _needs_generation_options():
    """``max_cache_len`` and ``disable_compile`` are generation options of recent transformers."""
    import transformers as T

    options = T.GenerationConfig()
    missing = [name for name in ("max_cache_len", "disable_compile") if not hasattr(options, name)]
    if missing:
        pytest.skip(f"this transformers ({T.__version__}) has no generation option {', '.join(missing)}")


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static",
                              max_cache_len=CACHE_LEN, pad_token_id=0, disable_compile=True)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_static_cache_generation_matches_eager_with_every_site_rewritten(family, impl):
    _needs_generation_options()
    model = _tiny_decoder(family, impl)
    ids = torch.randint(3, 64, (2, PROMPT), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected = _generate(model, ids)

    compiles = []  # (query length of the compiled step, its report)

    def backend(gm, example_inputs):
        compiled = flash_inductor.backend(gm, example_inputs)
        ids_in = [t for t in example_inputs if isinstance(t, torch.Tensor) and t.dtype == torch.long and t.dim() == 2]
        compiles.append((ids_in[0].shape[1] if ids_in else None, flash_inductor.last_report()))
        return compiled

    model.forward = torch.compile(model.forward, backend=backend)
    with inductor_codegen_skipped():
        tokens = _generate(model, ids)
    assert torch.equal(tokens, expected), (tokens, expected)

    steps = {length for length, _ in compiles}
    assert {PROMPT, 1} <= steps, f"expected a prefill and a decode-step compile, got lengths {steps}"
    for length, report in compiles:
        assert len(report.records) == 2 and report.kept == 0, f"step of length {length}:\n{report.format()}"
        # The cache is passed whole with its mask (GQA kept unrepeated), not a slice of it.
        assert all("mask" in r.detail and "GQA" in r.detail for r in report.records), report.format()
