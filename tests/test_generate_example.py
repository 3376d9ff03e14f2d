"""examples/generate_llama.py on the CPU (the PyTorch path, and the decode kernels in Triton's interpreter): greedy
generation through flash_attn_with_kvcache on shuffled pages gives transformers' SDPA tokens and first logits, and
leaves each sequence's rows in its pages."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import generate_llama

from helpers import TARGETS

CPU_TARGETS = [t for t in TARGETS if t.device == "cpu"]


@pytest.mark.parametrize("backend", CPU_TARGETS, indirect=True, ids=str)
def test_greedy_generation_matches_sdpa(backend):
    """The same tokens and first logits as transformers' SDPA loop with its dynamic cache and with its static one
    (ours is generated once: the cache kind is the reference's)."""
    generate_llama.register()
    model = generate_llama.build_model("tiny", torch.float32, "cpu")
    prompt = torch.randint(0, model.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(1))
    ours, logits, *_ = generate_llama.generate_flashtriton(model, prompt, new_tokens=6, page_size=4)
    assert ours.shape == (3, 6)
    for static in (False, True):
        theirs, their_logits, *_ = generate_llama.generate_sdpa(model, prompt, new_tokens=6, static=static)
        torch.testing.assert_close(logits, their_logits, rtol=1e-4, atol=1e-4, msg=f"static={static}")
        assert torch.equal(ours, theirs), f"static={static}"


def test_cache_holds_the_sequence_in_its_pages():
    """After a prefill, the pages of layer 0 hold the keys transformers' own cache holds, in block-table order."""
    from transformers import DynamicCache

    generate_llama.register()
    model = generate_llama.build_model("tiny", torch.float32, "cpu")
    prompt = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    cache = generate_llama.PagedCache.empty(model.config, 2, 16, 4, torch.float32, "cpu")
    model.set_attn_implementation(generate_llama.NAME)
    with torch.inference_mode():
        positions = torch.arange(10)[None].expand(2, -1)
        model(input_ids=prompt, position_ids=positions, use_cache=False, kv_cache=cache)
        model.set_attn_implementation("sdpa")
        reference = DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=reference, use_cache=True)
    keys = cache.k[0][cache.block_table.long()].flatten(1, 2)[:, :10]  # (batch, rows, heads_k, head_dim)
    torch.testing.assert_close(keys, reference.layers[0].keys.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert cache.cache_seqlens.tolist() == [0, 0]  # the step function advances them, not the attention
