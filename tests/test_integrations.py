"""flashtriton.integrations.transformers: tiny random-weight models in fp32 on CPU (flashtriton's PyTorch path), their
logits and gradients against the same model in fp64 under transformers' own attention, by the one tolerance rule
(plain = transformers' attention in fp32). A spy on the integration's calls checks which flashtriton entry point ran
and with which options, so a case cannot pass by not reaching flashtriton."""

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (requirements-dev.txt pins the version CI tests)"
)

from flashtriton.integrations import transformers as integration  # noqa: E402
from helpers import assert_close_to_reference  # noqa: E402

NAME = integration.register()
VOCAB = 97
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=256, pad_token_id=0,
)  # fmt: skip
WINDOW = 8
GEMMA2 = dict(
    num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=2.0, query_pre_attn_scalar=24
)


def _configs() -> dict:
    """name: (config, transformers' reference attention, the options each layer's call must carry)."""
    return {
        "llama-gqa": (transformers.LlamaConfig(**TINY, num_key_value_heads=2), "sdpa", {}),
        "qwen3-mqa": (transformers.Qwen3Config(**TINY, num_key_value_heads=1, head_dim=24), "sdpa", {}),
        "mistral-window": (
            transformers.MistralConfig(**TINY, num_key_value_heads=2, sliding_window=WINDOW),
            "sdpa",
            {"window_size": (WINDOW - 1, WINDOW - 1)},
        ),
        # layer 0 slides, layer 1 is global; sdpa has no softcap, so transformers' reference is eager
        "gemma2-softcap-window": (transformers.Gemma2Config(**TINY, **GEMMA2), "eager", {"softcap": 2.0}),
    }


CONFIGS = _configs()


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, dict]]:
    """(entry point, options) of each flashtriton call the integration makes."""
    seen = []
    for entry in ("flash_attn_func", "flash_attn_varlen_func"):
        original = getattr(integration, entry)

        def spy(*args, _entry=entry, _original=original, **options):
            seen.append((_entry, options))
            return _original(*args, **options)

        monkeypatch.setattr(integration, entry, spy)
    return seen


def _model(config, implementation: str, auto=None):
    torch.manual_seed(0)
    auto = auto or transformers.AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation=implementation)
    return model.eval()


def _logits_and_grads(model, implementation: str, dtype, ids, real, rows_alone=False, **inputs):
    """Logits and parameter gradients of a copy of model in dtype under implementation; the loss is the logits' dot
    with fixed random weights over the real tokens. rows_alone: each row's real tokens run as a batch of one, without
    padding, their logits placed back at their positions (zeros elsewhere)."""
    model = copy.deepcopy(model).to(dtype)
    model.set_attn_implementation(implementation)
    weights = torch.randn((*ids.shape, VOCAB), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights = weights.to(dtype) * real[..., None]
    if rows_alone:
        logits = torch.zeros(weights.shape, dtype=dtype)
        unmasked = {k: v for k, v in inputs.items() if k not in ("attention_mask", "position_ids")}
        for row in range(ids.shape[0]):
            logits[row, real[row]] = model(input_ids=ids[row, real[row]][None], **unmasked).logits[0]
    else:
        logits = model(input_ids=ids, **inputs).logits
    (logits * weights).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_matches_transformers(model, reference: str, ids, real, rows_alone=False, ours=NAME, **inputs) -> None:
    """Ours (the implementation named ``ours``) in fp32 against the reference in fp64, with the reference in fp32 as
    the plain error, on the real tokens' logits and on every parameter's gradient. rows_alone: the reference runs
    each row's real tokens alone."""
    ours = _logits_and_grads(model, ours, torch.float32, ids, real, **inputs)
    exact, plain = (
        _logits_and_grads(model, reference, dtype, ids, real, rows_alone, **inputs)
        for dtype in (torch.float64, torch.float32)
    )
    assert_close_to_reference("logits", ours[0][real], exact[0][real], plain[0][real])
    assert ours[1].keys() == exact[1].keys()
    for name in exact[1]:
        assert_close_to_reference(f"grad {name}", ours[1][name], exact[1][name], plain[1][name])


@pytest.mark.parametrize("case", CONFIGS)
def test_unpadded_batch(case, calls):
    config, reference, options = CONFIGS[case]
    ids = torch.randint(1, VOCAB, (2, 21))
    real = torch.ones(ids.shape, dtype=torch.bool)
    _assert_matches_transformers(_model(config, NAME), reference, ids, real, use_cache=False)
    assert calls and all(entry == "flash_attn_func" and kwargs["causal"] for entry, kwargs in calls)
    for option, value in options.items():
        assert any(kwargs[option] == value for _, kwargs in calls), f"no call had {option}={value}"


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("case", ["llama-gqa", "gemma2-softcap-window"])
def test_padded_batch(case, side, calls):
    """Rows of 21, 13 and 6 real tokens, against each row's real tokens run alone by transformers' attention (in
    fp64 its eager attention turns rows that see no key into NaN, which a padded reference would spread)."""
    config, reference, _ = CONFIGS[case]
    ids = torch.randint(1, VOCAB, (3, 21))
    mask = torch.zeros(ids.shape, dtype=torch.long)
    for row, length in enumerate((21, 13, 6)):
        mask[row, -length:] = 1 if side == "left" else 0
        if side == "right":
            mask[row, :length] = 1
    real = mask.bool()
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)  # as generate() numbers them: 0 at each row's first token
    model = _model(config, NAME)
    masks = dict(attention_mask=mask, position_ids=position_ids)
    _assert_matches_transformers(model, reference, ids, real, True, use_cache=False, **masks)
    assert calls and all(entry == "flash_attn_varlen_func" for entry, _ in calls)


@pytest.mark.parametrize("case", ["llama-gqa", "mistral-window"])
def test_packed_batch(case, calls):
    """Three sequences in one row, as DataCollatorWithFlattening packs them (position_ids restart at 0): against
    transformers' attention on the same packed row (which masks across sequences from the position_ids)."""
    config, reference, _ = CONFIGS[case]
    lengths = (9, 13, 4)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    real = torch.ones(ids.shape, dtype=torch.bool)
    _assert_matches_transformers(_model(config, NAME), reference, ids, real, use_cache=False, position_ids=position_ids)
    assert calls and all(entry == "flash_attn_varlen_func" for entry, _ in calls)


def test_bidirectional_padded_batch(calls):
    """BERT (an encoder: is_causal False), right-padded rows of 13 and 9 tokens, against each row alone."""
    config = transformers.BertConfig(**{k: v for k, v in TINY.items() if k != "max_position_embeddings"})
    model = _model(config, NAME, transformers.AutoModelForMaskedLM)
    ids = torch.randint(1, VOCAB, (2, 13))
    mask = torch.ones(ids.shape, dtype=torch.long)
    mask[1, 9:] = 0
    _assert_matches_transformers(model, "sdpa", ids, mask.bool(), True, attention_mask=mask)
    assert calls and all(entry == "flash_attn_varlen_func" and not kwargs["causal"] for entry, kwargs in calls)


def test_packed_batch_equals_separate_sequences(calls):
    """The packed row's logits are those of each sequence run alone (precomputed cu_seq_lens kwargs too)."""
    model = _model(CONFIGS["llama-gqa"][0], NAME)
    lengths = (9, 13, 4)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)))
    with torch.no_grad():
        alone = torch.cat([model(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        from_positions = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        cu_seqlens = torch.tensor([0, 9, 22, 26], dtype=torch.int32)
        flash_kwargs = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=13, max_length_k=13)
        from_kwargs = model(input_ids=ids, position_ids=position_ids, use_cache=False, **flash_kwargs).logits
    # the same per-sequence attention either way; only the order of float sums differs with the batch layout
    torch.testing.assert_close(from_positions, alone, rtol=0, atol=1e-5)
    assert torch.equal(from_kwargs, from_positions)


@pytest.mark.parametrize(
    "case, cache, padded",
    [
        ("llama-gqa", "dynamic", True),
        ("llama-gqa", "static", True),
        ("llama-gqa", "static", False),
        ("mistral-window", "dynamic", True),
        ("gemma2-softcap-window", "dynamic", False),
    ],
)
def test_generate_greedy(case, cache, padded, calls):
    """Greedy tokens as transformers' attention's: prompts of 14 tokens (longer than the window), left-padded to 14
    and 9 real tokens when padded, then 6 new tokens decoded against the cache (queries aligned bottom-right)."""
    config, reference, _ = CONFIGS[case]
    model = _model(config, NAME)
    ids = torch.randint(1, VOCAB, (2, 14))
    mask = torch.ones(ids.shape, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
        ids[1, :5] = 0
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation=cache)
    ours = model.generate(ids, **settings)
    model.set_attn_implementation(reference)
    theirs = model.generate(ids, **settings)
    assert torch.equal(ours, theirs)
    entries = {entry for entry, _ in calls}
    # a padded batch runs varlen until the padding falls out of a sliding layer's cache; a static cache's unwritten
    # tail is sliced off, leaving dense calls
    assert "flash_attn_varlen_func" in entries if padded else entries == {"flash_attn_func"}
    assert all(kwargs["causal"] for _, kwargs in calls)


def test_dropout_follows_training_mode(calls):
    config = copy.deepcopy(CONFIGS["llama-gqa"][0])
    config.attention_dropout = 0.25
    model = _model(config, NAME)
    ids = torch.randint(1, VOCAB, (1, 12))
    model.train()
    model(input_ids=ids, use_cache=False)
    model.eval()
    model(input_ids=ids, use_cache=False)
    layers = config.num_hidden_layers
    assert [kwargs["dropout_p"] for _, kwargs in calls] == [0.25] * layers + [0.0] * layers


def _gpt_oss(implementation: str, padded: bool):
    """(a tiny gpt-oss under implementation, sliding and full layers in turn, its sinks moved away from their zero
    init so that a call that dropped them would show; ids (2, 16); the attention mask, left-padding row 1 to 9 real
    tokens where padded)."""
    config = transformers.GptOssConfig(
        **TINY, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        experts_implementation="eager",  # torch's grouped_mm takes no fp64, which the reference runs in
    )  # fmt: skip
    model = _model(config, implementation)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(config.num_attention_heads) + 2.0)
    ids = torch.randint(1, VOCAB, (2, 16))
    mask = torch.ones(ids.shape, dtype=torch.long)
    if padded:
        mask[1, :7] = 0
    return model, ids, mask


NO_GPT_OSS = pytest.mark.skipif(not hasattr(transformers, "GptOssConfig"), reason="this transformers has no gpt-oss")


@NO_GPT_OSS
@pytest.mark.parametrize("padded", [False, True])
def test_gpt_oss_sinks(padded, calls):
    """gpt-oss's learnable sinks (s_aux, a (nheads,) parameter per layer; sliding and full layers in turn) against
    transformers' eager attention, its sinks' gradients included; padded: left-padded rows of 16 and 9 real tokens
    through varlen, against each row alone (_gpt_oss)."""
    model, ids, mask = _gpt_oss(NAME, padded)
    real = mask.bool()
    masks = dict(attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0)) if padded else {}
    # the gradients compared include every sinks parameter's: transformers' attention gives them one
    assert any(name.endswith("self_attn.sinks") for name, _ in model.named_parameters())
    _assert_matches_transformers(model, "eager", ids, real, padded, use_cache=False, **masks)
    entry = "flash_attn_varlen_func" if padded else "flash_attn_func"
    assert calls and all(e == entry and kwargs["sinks"] is not None for e, kwargs in calls)


@NO_GPT_OSS
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_transformers_flash_wrapper_takes_flashtriton_as_a_hub_kernel(padded, monkeypatch):
    """transformers' own flash attention wrapper, handed flashtriton's flash_attn_func and flash_attn_varlen_func
    as it takes a hub kernel's, reads the options they accept from their signatures (dropout_p, window_size,
    softcap, deterministic, learnable_sink, max_seqlen_q/k) and passes gpt-oss's sinks and sliding window through;
    logits and gradients against eager as test_gpt_oss_sinks checks the integration. A spy on the two functions
    proves they served every layer with the sinks and, on the sliding layers, the window."""
    import transformers.modeling_flash_attention_utils as fa
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import flash_attention_mask

    import flashtriton

    seen = []

    def spied(entry):
        def call(*args, **options):
            seen.append((entry.__name__, options))
            return entry(*args, **options)

        call.__signature__ = inspect.signature(entry)  # what transformers introspects
        return call

    kernel = (spied(flashtriton.flash_attn_func), spied(flashtriton.flash_attn_varlen_func))
    monkeypatch.setattr(fa, "_lazy_imports", lambda *args, **kwargs: (*kernel, None, fa._pad_input, fa._unpad_input))
    # transformers keeps what it loaded in module globals: restored after the test, as the registrations are
    for loaded in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                   "_unpad_fn", "_process_flash_kwargs_fn"):  # fmt: skip
        monkeypatch.setattr(fa, loaded, None)
    name = "hub_entry_test"  # without "flash" or "/", which would make transformers fetch a kernel
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, name, flash_attention_forward)
    monkeypatch.setitem(transformers.AttentionMaskInterface._global_mapping, name, flash_attention_mask)
    model, ids, mask = _gpt_oss(name, padded)
    real = mask.bool()
    masks = dict(attention_mask=mask) if padded else {}
    _assert_matches_transformers(model, "eager", ids, real, padded, ours=name, use_cache=False, **masks)
    entry = "flash_attn_varlen_func" if padded else "flash_attn_func"
    assert seen and all(e == entry and options["learnable_sink"] is not None for e, options in seen)
    assert any(options.get("window_size") == (WINDOW - 1, WINDOW - 1) for _, options in seen)


def test_custom_4d_mask_raises():
    model = _model(CONFIGS["llama-gqa"][0], NAME)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="2-D attention_mask"):
        model(input_ids=torch.randint(1, VOCAB, (1, 8)), attention_mask=mask)


@pytest.mark.parametrize("decoder_rows", [1, 3, 12])
def test_cross_attention_keeps_every_query_of_a_padded_encoder(decoder_rows):
    """An encoder-decoder's cross-attention gets the encoder's padding mask: every decoder query is real (at lengths
    that differ from the encoder's), each seeing the encoder's real tokens only, as SDPA with that mask."""

    class CrossAttention(torch.nn.Module):
        is_causal = False

    q = torch.randn(2, 4, decoder_rows, 16)
    k, v = (torch.randn(2, 4, 10, 16) for _ in range(2))
    encoder = torch.ones(2, 10, dtype=torch.bool)
    encoder[1, 6:] = False  # the second row's encoder input is right-padded
    mask = integration.padding_mask(2, decoder_rows, 10, attention_mask=encoder)
    out, _ = integration.attention(CrossAttention(), q, k, v, mask)
    exact, plain = (
        torch.nn.functional.scaled_dot_product_attention(
            *(x.to(dtype) for x in (q, k, v)), attn_mask=encoder[:, None, None, :]
        ).transpose(1, 2)
        for dtype in (torch.float64, torch.float32)
    )
    assert_close_to_reference(f"cross-attention, {decoder_rows} decoder rows", out, exact, plain)


def test_a_padding_mask_with_holes_under_a_sliding_window_raises():
    """Packed together, a row's real tokens with zeros between them would shift a sliding window from positions to
    real tokens; without a window (or with left padding) the packing changes nothing and the call runs."""

    class SelfAttention(torch.nn.Module):
        is_causal = True

    q, k, v = (torch.randn(2, 2, 10, 16) for _ in range(3))
    holes = torch.ones(2, 10, dtype=torch.bool)
    holes[1, 4:6] = False
    with pytest.raises(NotImplementedError, match="zeros between a row's real tokens"):
        integration.attention(SelfAttention(), q, k, v, holes, sliding_window=3)
    integration.attention(SelfAttention(), q, k, v, holes)
    integration.attention(SelfAttention(), q, k, v, holes, sliding_window=10)  # hides no key of 10
    left = torch.ones(2, 10, dtype=torch.bool)
    left[1, :4] = False
    integration.attention(SelfAttention(), q, k, v, left, sliding_window=3)


def test_masks_the_attention_does_not_compute_raise():
    """Chunked attention (Llama4) past its first chunk and unions of masks would otherwise run as plain causal
    attention; within one chunk a chunked mask is causal and runs."""
    masks = transformers.masking_utils
    chunked = masks.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="chunked"):
        integration.padding_mask(1, 12, 12, mask_function=chunked)
    assert integration.padding_mask(1, 4, 4, mask_function=chunked) is None
    union = masks.or_masks(masks.causal_mask_function, masks.bidirectional_mask_function)
    with pytest.raises(NotImplementedError, match="union of masks"):
        integration.padding_mask(1, 8, 8, mask_function=union)
    for plain in (masks.causal_mask_function, masks.sliding_window_causal_mask_function(4)):
        assert integration.padding_mask(1, 8, 8, mask_function=plain) is None


def test_register_rejects_flash_in_name():
    with pytest.raises(ValueError, match="contains 'flash'"):
        integration.register("my_flash_attention")


def test_register_returns_name():
    assert integration.register("triton_attention_test") == "triton_attention_test"
    assert "triton_attention_test" in transformers.AttentionInterface._global_mapping
