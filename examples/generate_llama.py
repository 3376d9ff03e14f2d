"""Greedy generation with a random-weight transformers Llama: prefill and decode through flashtriton's
flash_attn_with_kvcache on a paged KV cache, against transformers' own SDPA generation loop on the same model.

    python examples/generate_llama.py --device cpu --model tiny --new-tokens 16      # any machine, fp32
    python examples/generate_llama.py --batch 8 --prompt 1024 --new-tokens 128        # one GPU, bf16
    python examples/generate_llama.py ... --graph      # each decode step replayed from a CUDA graph (ours)

The model is transformers' LlamaForCausalLM (GQA, rotary), random weights, run in eval mode. flashtriton's side
registers an attention function (``triton_kvcache``) that transformers calls with each layer's new, already rotated
queries, keys and values; it appends the keys and values to that layer's pages at ``cache_seqlens`` and attends to
the whole cache in one call (a prefill's queries causal, aligned to the cache's end), which is how a serving engine
drives flash_attn_with_kvcache. Pages are handed out in a shuffled order, as a long-running engine's free list would.
The peers run the same greedy loop through transformers' SDPA attention with its DynamicCache (the default) and its
StaticCache.

Prints decode tokens/s (batch x the new tokens after the first, over their decode steps' time, the best of --repeats
runs; the prefill, which gives the first, timed apart), each
run's first-step logits' largest error against the same weights in fp32 (bf16 and fp16 runs), and whether each peer
produced the same tokens as flashtriton: with random weights the top logits of a step are close, so low-precision runs
of either attention part ways early; on the CPU in fp32 the tokens are the same (tests/test_generate_example.py).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from flashtriton import flash_attn_with_kvcache

NAME = "triton_kvcache"  # transformers reserves attention names containing "flash" for its own kernels

MODELS = {  # hidden, layers, heads, K/V heads, intermediate
    "tiny": (64, 2, 4, 2, 128),
    "1b": (2048, 16, 16, 4, 5632),
}


@dataclass
class PagedCache:
    """Per layer, K and V pages (pages, page_size, heads_k, head_dim); the batch's block table (batch, pages per
    sequence) int32 over shuffled pages; cache_seqlens (batch,) int32: the rows written so far."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor

    @classmethod
    def empty(cls, config, batch: int, capacity: int, page_size: int, dtype, device) -> PagedCache:
        pages = -(-capacity // page_size)
        shape = (batch * pages, page_size, config.num_key_value_heads, config.head_dim)
        layers = config.num_hidden_layers
        table = torch.randperm(batch * pages, device=device).to(torch.int32).view(batch, pages)
        k, v = ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)] for _ in range(2))
        return cls(k, v, table, torch.zeros(batch, dtype=torch.int32, device=device))


def attention(module, query, key, value, attention_mask, scaling=None, kv_cache: PagedCache | None = None, **kwargs):
    """transformers' attention function: (batch, heads, n, head_dim) new queries, keys and values of one layer."""
    if kv_cache is None:
        raise ValueError(f"attn_implementation={NAME!r} needs the forward's kv_cache=PagedCache(...)")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # flash_attn's (batch, n, heads, head_dim) views
    layer = module.layer_idx
    out = flash_attn_with_kvcache(
        q, kv_cache.k[layer], kv_cache.v[layer], k, v, cache_seqlens=kv_cache.cache_seqlens,
        block_table=kv_cache.block_table, softmax_scale=scaling, causal=True,
    )  # fmt: skip
    return out, None


def register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)  # the cache's lengths are the mask


def build_model(name: str, dtype: torch.dtype, device: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, heads_k, intermediate = MODELS[name]
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads_k,
        intermediate_size=intermediate, vocab_size=32000, max_position_embeddings=1 << 17,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: a CPU initialisation of 1B weights takes a while
        return LlamaForCausalLM(config).to(dtype).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def generate_flashtriton(model, prompt: torch.Tensor, new_tokens: int, page_size: int, graph: bool = False):
    """(tokens (batch, new_tokens), first step's logits, prefill seconds, decode seconds)."""
    model.set_attn_implementation(NAME)
    batch, length = prompt.shape
    device = str(prompt.device)
    cache = PagedCache.empty(model.config, batch, length + new_tokens, page_size, model.dtype, prompt.device)

    def step(ids: torch.Tensor) -> torch.Tensor:
        positions = cache.cache_seqlens[:, None].long() + torch.arange(ids.shape[1], device=ids.device)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False, kv_cache=cache).logits[:, -1]
        cache.cache_seqlens.add_(ids.shape[1])
        return logits

    start = time.perf_counter()
    first = step(prompt)
    _sync(device)
    prefill = time.perf_counter() - start
    ids = first.argmax(-1, keepdim=True)
    tokens = [ids]
    decode_step = step
    if graph:  # one step captured: the inputs are static buffers, the cache's lengths advance inside the graph
        static_ids = ids.clone()
        saved = cache.cache_seqlens.clone()
        step(static_ids)  # compile and warm everything for this shape outside the capture
        cache.cache_seqlens.copy_(saved)  # (the step's rows are written again by the first replay)
        replay = torch.cuda.CUDAGraph()
        with torch.cuda.graph(replay):  # records the step; runs nothing
            static_logits = step(static_ids)

        def decode_step(ids: torch.Tensor) -> torch.Tensor:
            static_ids.copy_(ids)
            replay.replay()
            return static_logits

    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        ids = decode_step(ids).argmax(-1, keepdim=True)
        tokens.append(ids)
    _sync(device)
    return torch.cat(tokens, 1), first.float(), prefill, time.perf_counter() - start


@torch.inference_mode()
def generate_sdpa(model, prompt: torch.Tensor, new_tokens: int, static: bool):
    """The same greedy loop through transformers' SDPA attention and its own cache (StaticCache or DynamicCache)."""
    from transformers import DynamicCache, StaticCache

    model.set_attn_implementation("sdpa")
    length = prompt.shape[1]
    device = str(prompt.device)
    cache = (
        StaticCache(config=model.config, max_cache_len=length + new_tokens)
        if static
        else DynamicCache(config=model.config)
    )
    start = time.perf_counter()
    first = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]
    _sync(device)
    prefill = time.perf_counter() - start
    ids = first.argmax(-1, keepdim=True)
    tokens = [ids]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        ids = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(ids)
    _sync(device)
    return torch.cat(tokens, 1), first.float(), prefill, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on CUDA, float32 on the CPU")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--graph", action="store_true", help="replay flashtriton's decode step from a CUDA graph")
    parser.add_argument("--repeats", type=int, default=2, help="runs per provider, the fastest kept (the first warms)")
    args = parser.parse_args()
    if args.graph and not args.device.startswith("cuda"):
        parser.error("--graph captures CUDA graphs: it needs --device cuda")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    register()
    model = build_model(args.model, dtype, args.device)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device=args.device)
    runs = {
        "flashtriton": lambda: generate_flashtriton(model, prompt, args.new_tokens, args.page_size, args.graph),
        "sdpa (DynamicCache)": lambda: generate_sdpa(model, prompt, args.new_tokens, static=False),
        "sdpa (StaticCache)": lambda: generate_sdpa(model, prompt, args.new_tokens, static=True),
    }
    results = {name: [run() for _ in range(args.repeats)] for name, run in runs.items()}
    reference = first_logits_fp32(model, prompt) if dtype != torch.float32 else None
    tokens = results["flashtriton"][-1][0]
    graph = ", decode graph" if args.graph else ""
    print(f"{args.model} Llama, {dtype}, {args.device}: batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, pages of {args.page_size}{graph}; best of {args.repeats} runs")  # fmt: skip
    error = "first logits' error" if reference is not None else ""
    print(f"{'':20} {'decode tok/s':>12} {'prefill ms':>10}  {error:>19}  same tokens as flashtriton")
    for name, runs_of in results.items():
        theirs, logits = runs_of[-1][:2]
        rate = args.batch * (args.new_tokens - 1) / min(r[3] for r in runs_of)
        prefill = min(r[2] for r in runs_of)
        same = (theirs == tokens).all(1)
        parted = (theirs != tokens).int().argmax(1)[~same]  # each parted sequence's first differing step
        agreement = f"{int(same.sum())} of {args.batch}"
        if len(parted):
            agreement += f" (first parting at step {int(parted.min())})"
        err = f"{float((logits - reference).abs().max()):19.3e}" if reference is not None else " " * 19
        print(f"{name:20} {rate:12.1f} {prefill * 1e3:10.1f}  {err}  {agreement if name != 'flashtriton' else ''}")


@torch.inference_mode()
def first_logits_fp32(model, prompt: torch.Tensor) -> torch.Tensor:
    """The first step's logits of the same weights in fp32 (transformers' eager attention): each run's error is its
    distance from these; with random weights the top logits are close, so greedy tokens part where errors differ."""
    model.float().set_attn_implementation("eager")
    return model(input_ids=prompt, use_cache=False).logits[:, -1].float()


if __name__ == "__main__":
    main()
