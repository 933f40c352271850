"""The checkout's own AscendC operators emulated from their docs (validators/npu_ops/custom_ops.py, issue 38).

Each result is checked against an independent computation (the interleaved RoPE as a complex rotation of each
lane pair; the scatter as plain row assignment), and each documented argument rule with a call that breaks it.
"""

from __future__ import annotations

import re
import types

import pytest
import torch
from model_infer_kvcache.validators.npu_ops.custom_ops import inplace_partial_rotary_mul, scatter_nd_update_asc
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError


def _tables(b: int, s: int, width: int, per_token: bool):
    """cos / sin tables in the interleaved layout upstream deepseek_v4 builds: each angle twice, one per lane of a
    pair; and the angles themselves."""
    theta = torch.rand(b, s if per_token else 1, 1, width // 2, dtype=torch.float64) * 6.0
    return (theta.cos().repeat_interleave(2, -1), theta.sin().repeat_interleave(2, -1), theta)


@pytest.mark.parametrize("per_token", [False, True])
def test_partial_rotary_rotates_only_the_slice_as_complex_pairs(per_token):
    b, s, n, d, start = 3, 4, 2, 16, 6
    x = torch.randn(b, s, n, d, dtype=torch.float64)
    before = x.clone()
    cos, sin, theta = _tables(b, s, d - start, per_token)
    storage = x.data_ptr()
    inplace_partial_rotary_mul(x, cos, sin, rotary_mode="interleave", partial_slice=[start, d])
    assert x.data_ptr() == storage  # in place
    assert torch.equal(x[..., :start], before[..., :start])  # the nope part untouched
    pairs = torch.view_as_complex(before[..., start:].reshape(b, s, n, -1, 2).contiguous())
    want = torch.view_as_real(pairs * torch.polar(torch.ones_like(theta), theta)).reshape(b, s, n, -1)
    assert torch.allclose(x[..., start:], want, atol=1e-12)


def test_partial_rotary_keeps_x_dtype_with_float32_tables():
    x = torch.randn(2, 1, 1, 8, dtype=torch.bfloat16)
    cos, sin, _ = _tables(2, 1, 4, False)
    ref = x.clone().to(torch.float64)
    inplace_partial_rotary_mul(x, cos.float(), sin.float(), rotary_mode="interleave", partial_slice=[4, 8])
    inplace_partial_rotary_mul(ref, cos, sin, rotary_mode="interleave", partial_slice=[4, 8])
    assert x.dtype == torch.bfloat16 and torch.allclose(x.double(), ref, atol=2e-2)


@pytest.mark.parametrize("mutate, argument", [
    (lambda a: a.update(rotary_mode="half"), "rotary_mode"),  # the doc supports interleave only
    (lambda a: a.update(partial_slice=[5, 16]), "partial_slice"),  # odd slice
    (lambda a: a.update(partial_slice=[8]), "partial_slice"),
    (lambda a: a.update(r1=a["r1"][..., :4].contiguous()), "r1"),  # table narrower than the slice
    (lambda a: a.update(r2=a["r2"].to(torch.float16)), "r2"),  # r1 / r2 dtypes differ
    (lambda a: a.update(r1=a["r1"].expand(2, 3, 1, 8)), "r1"),  # non-contiguous table
    (lambda a: a.update(x=torch.randn(2, 3, 1, 1026)), "x"),  # d above 1024
])
def test_partial_rotary_refuses_what_its_doc_rules_out(mutate, argument):
    args = {"x": torch.randn(2, 3, 1, 16), "r1": torch.randn(2, 1, 1, 8), "r2": torch.randn(2, 1, 1, 8),
            "rotary_mode": "interleave", "partial_slice": [8, 16]}
    mutate(args)
    with pytest.raises(NpuOpError) as info:
        inplace_partial_rotary_mul(args.pop("x"), args.pop("r1"), args.pop("r2"), **args)
    assert info.value.argument == argument, info.value


def test_scatter_writes_rows_and_skips_negative_indices():
    var = torch.zeros(6, 128, dtype=torch.bfloat16)
    update = torch.randn(3, 128).to(torch.bfloat16)
    scatter_nd_update_asc(var, torch.tensor([[4], [-1], [0]], dtype=torch.int32), update)
    assert torch.equal(var[4], update[0]) and torch.equal(var[0], update[2])
    assert not var[[1, 2, 3, 5]].any()  # the skipped update wrote nowhere


@pytest.mark.parametrize("var, indices, update, argument, error", [
    (torch.zeros(4, 64), torch.tensor([[0]]), torch.zeros(1, 64), "var", NpuOpError),  # float32 var
    (torch.zeros(4, 64, dtype=torch.float16), torch.tensor([[0]]), torch.zeros(1, 64, dtype=torch.float16), "var",
     NpuOpError),  # row width 64
    (torch.zeros(4, 128, dtype=torch.float16), torch.tensor([[4]]), torch.zeros(1, 128, dtype=torch.float16),
     "indices", NpuOpError),  # out of range
    (torch.zeros(2, 1, dtype=torch.int8), torch.tensor([[0], [1], [1]]), torch.zeros(3, 1, dtype=torch.int8),
     "indices", NpuOpError),  # more updates than rows
    (torch.zeros(4, 1, dtype=torch.int8), torch.tensor([[1], [1]]), torch.zeros(2, 1, dtype=torch.int8), "indices",
     UnemulatedFeatureError),  # one row updated twice: the doc fixes no order
    (torch.zeros(4, 1, dtype=torch.int8), torch.tensor([[1]]), torch.zeros(1, 1, dtype=torch.float16), "update",
     NpuOpError),  # dtype differs from var
    (torch.zeros(4, 1, dtype=torch.int8), torch.tensor([[1.0]]), torch.zeros(1, 1, dtype=torch.int8), "indices",
     NpuOpError),  # float indices
])
def test_scatter_refuses_what_its_doc_rules_out(var, indices, update, argument, error):
    with pytest.raises(error) as info:
        scatter_nd_update_asc(var, indices, update)
    assert info.value.argument == argument, info.value


def test_the_checkout_stand_ins_answer_with_the_emulations_and_name_the_rest():
    from model_infer_kvcache.validators.npu_ops.errors import UnemulatedOperatorError
    from model_infer_kvcache.validators.standins.device import device_standins

    with device_standins():
        assert torch.ops.custom.scatter_nd_update_asc is scatter_nd_update_asc
        assert torch.ops.custom.compressor.__module__.endswith("custom_ops")
        assert torch.ops.custom.npu_quant_lightning_indexer.__module__.endswith("custom_ops")
        assert not hasattr(torch.ops.custom, "quant_compressor")  # a model's fallback can probe it
        with pytest.raises(UnemulatedOperatorError, match="torch.ops.custom.quant_compressor"):
            torch.ops.custom.quant_compressor(None)


# ---------------------------------------------------------------- custom.compressor against transformers' compressors


def _v4_compressor(kind: str):
    """transformers' DeepseekV4{HCA,CSA}Compressor at the kernel's shapes (D 512, H 1024, rope 64), float64, every
    parameter random (position_bias is allocated uninitialised, kv_norm starts at ones)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    torch.manual_seed(0)
    config = DeepseekV4Config(hidden_size=1024, head_dim=512, qk_rope_head_dim=64, num_attention_heads=8,
                              num_key_value_heads=1, q_lora_rank=256, index_n_heads=4, index_head_dim=128,
                              index_topk=8, num_hidden_layers=2, vocab_size=64)
    module = (v4.DeepseekV4CSACompressor if kind == "csa" else v4.DeepseekV4HCACompressor)(config).double().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.05)
        module.position_bias.normal_(0, 1.0)
        module.kv_norm.weight.normal_(1.0, 0.2)
    return module, config


def _oracle_entries(module, x):
    """Every entry of the whole sequence in one stateless call (cache None: each complete window)."""
    n = x.shape[1]
    with torch.no_grad():
        q_residual = torch.randn(1, n, 256, dtype=torch.float64)
        kv, _ = module(x, q_residual, torch.arange(n)[None], None, 0)
    return kv[0, 0]


def _rope_rows(module, first_window: int, count: int):
    """cos / sin rows for ``count`` entries from window ``first_window`` on, at each entry's position (its window's
    first token, as transformers places it), expanded per lane (interleave layout)."""
    m = module.compress_rate
    positions = (torch.arange(first_window, first_window + count) * m)[None]
    probe = torch.zeros(1, count, 512, dtype=torch.float64)
    cos, sin = module.rotary_emb(probe, position_ids=positions, layer_type=module.rope_layer_type)
    return cos[0].repeat_interleave(2, -1).double(), sin[0].repeat_interleave(2, -1).double()


def _stream(module, x, chunks, *, shift: int = 0, block_size: int = 16):
    """Feed ``x`` through custom.compressor chunk by chunk (one request; one-token chunks as decode, BSH; the
    rest as prefill, TND), the states kept in a paged state cache; returns the entries in order."""
    from model_infer_kvcache.validators.npu_ops.custom_ops import compressor

    m, n = module.compress_rate, x.shape[1]
    coff = 2 if m == 4 else 1
    cols = -(-(n + shift) // block_size)
    state = torch.zeros(cols + 1, block_size, 2 * coff * 512, dtype=torch.float64)
    table = torch.arange(1, cols + 1, dtype=torch.int32)[None]
    got, start = [], 0
    for size in chunks:
        part, at = x[0, start:start + size], start + shift
        count = (at + size) // m - at // m
        decode = size == 1
        rows = 1 if decode else min(size, size // m + 1)
        cos = torch.zeros(rows, 64, dtype=torch.float64)
        sin = torch.zeros(rows, 64, dtype=torch.float64)
        if count:
            cos[:count], sin[:count] = _rope_rows(module, at // m, count)
        kwargs = {"state_block_table": table, "start_pos": torch.tensor([at], dtype=torch.int32),
                  "coff": coff, "norm_eps": module.kv_norm.variance_epsilon, "rotary_mode": 2}
        with torch.no_grad():
            out = _call(compressor, decode, part, module, state, sin, cos, m, size, kwargs)
        assert torch.isnan(out[count:]).all()  # pad rows are poisoned, never a plausible entry
        got.append(out[:count])
        start += size
    return torch.cat(got)


def _call(compressor, decode, part, module, state, sin, cos, m, size, kwargs):
    """One call: a decode step as upstream passes it (x [B, S, H], no cu_seqlens), a prefill chunk as TND."""
    weights = (module.kv_proj.weight, module.gate_proj.weight, state, module.position_bias, module.kv_norm.weight)
    if decode:
        return compressor(part[None].contiguous(), *weights, sin[None], cos[None], 64, m, **kwargs)[0]
    return compressor(part.contiguous(), *weights, sin, cos, 64, m,
                      cu_seqlens=torch.tensor([0, size], dtype=torch.int32), **kwargs)


@pytest.mark.parametrize("kind, n, chunks", [
    ("csa", 23, [7, 1, 1, 5, 1, 8]),  # groups of 4 completed across prefill chunks and decode steps, overlap state
    ("hca", 300, [130, 1, 100, 69]),  # groups of 128 straddling calls
])
def test_a_streamed_compressor_writes_the_entries_transformers_computes_in_one_pass(kind, n, chunks):
    module, _ = _v4_compressor(kind)
    x = torch.randn(1, n, 1024, dtype=torch.float64)
    want = _oracle_entries(module, x)
    got = _stream(module, x, chunks)
    assert got.shape == want.shape == (n // module.compress_rate, 512)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    # negative control: a start_pos one token off (the runner's length counter late by one) is caught by the same
    # comparison, not absorbed by it
    if kind == "csa":
        assert not torch.allclose(_stream(module, x, chunks, shift=1)[:3], want[:3], rtol=1e-5, atol=1e-6)


def test_a_state_the_next_call_needs_but_that_was_never_stored_is_refused():
    """Block id 0 marks "not stored": a window completed in a later call reads its first tokens from the state, and
    a runner that left them unstored gets a refusal naming the table, not entries pooled from stale rows."""
    from model_infer_kvcache.validators.npu_ops.custom_ops import compressor

    module, _ = _v4_compressor("csa")
    x = torch.randn(6, 1024, dtype=torch.float64)
    state = torch.zeros(2, 16, 2 * 2 * 512, dtype=torch.float64)
    zero_table = torch.zeros(1, 1, dtype=torch.int32)
    args = (module.kv_proj.weight, module.gate_proj.weight, state, module.position_bias, module.kv_norm.weight)
    rope = torch.zeros(2, 64, dtype=torch.float64)
    compressor(x, *args, rope, rope, 64, 4, state_block_table=zero_table, cu_seqlens=torch.tensor([0, 6],
               dtype=torch.int32), coff=2)
    with pytest.raises(NpuOpError, match="never stored") as info:
        compressor(x[:2], *args, rope[:1], rope[:1], 64, 4, state_block_table=zero_table,
                   cu_seqlens=torch.tensor([0, 2], dtype=torch.int32), start_pos=torch.tensor([6], dtype=torch.int32),
                   coff=2)
    assert info.value.argument == "state_block_table"


@pytest.mark.parametrize("change, argument, error", [
    ({"cmp_ratio": 128}, "cmp_ratio", NpuOpError),  # coff 2 with ratio 128: no such kernel case
    ({"rope_head_dim": 32}, "rope_head_dim", NpuOpError),
    ({"cache_mode": 2}, "cache_mode", UnemulatedFeatureError),  # documented, "目前暂不支持"
    ({"rotary_mode": 3}, "rotary_mode", NpuOpError),
    ({"state_block_table": None}, "state_block_table", UnemulatedFeatureError),
    ({"rope_sin": torch.zeros(3, 64, dtype=torch.float64)}, "rope_sin", NpuOpError),  # rows != min(T, T//m + B)
    ({"cu_seqlens": torch.tensor([0, 5], dtype=torch.int32)}, "cu_seqlens", NpuOpError),  # does not end at T
    ({"x": torch.randn(6, 1000, dtype=torch.float64)}, "x", NpuOpError),  # H not 512-aligned
])
def test_the_compressor_refuses_what_its_doc_rules_out(change, argument, error):
    from model_infer_kvcache.validators.npu_ops.custom_ops import compressor

    module, _ = _v4_compressor("csa")
    args = {"x": torch.randn(6, 1024, dtype=torch.float64), "wkv": module.kv_proj.weight,
            "wgate": module.gate_proj.weight, "state_cache": torch.zeros(2, 16, 2048, dtype=torch.float64),
            "ape": module.position_bias, "norm_weight": module.kv_norm.weight,
            "rope_sin": torch.zeros(2, 64, dtype=torch.float64), "rope_cos": torch.zeros(2, 64, dtype=torch.float64),
            "rope_head_dim": 64, "cmp_ratio": 4, "state_block_table": torch.ones(1, 1, dtype=torch.int32),
            "cu_seqlens": torch.tensor([0, 6], dtype=torch.int32), "coff": 2}
    args.update(change)
    with pytest.raises(error) as info:
        compressor(**args)
    assert info.value.argument == argument, info.value


def test_two_requests_in_one_call_pack_their_entries_in_batch_order_and_keep_their_own_states():
    """TND: request 0 and request 1 at different positions share each call; their entries are packed batch by batch
    (then the pad), and each request's windows pool only its own tokens (its own state blocks)."""
    from model_infer_kvcache.validators.npu_ops.custom_ops import compressor

    module, _ = _v4_compressor("csa")
    xs = [torch.randn(1, 14, 1024, dtype=torch.float64), torch.randn(1, 11, 1024, dtype=torch.float64)]
    wants = [_oracle_entries(module, x) for x in xs]
    state = torch.zeros(3, 16, 2048, dtype=torch.float64)
    table = torch.tensor([[1], [2]], dtype=torch.int32)  # one block per request
    weights = (module.kv_proj.weight, module.gate_proj.weight, state, module.position_bias, module.kv_norm.weight)
    got, starts = [[], []], [0, 0]
    for sizes in ([6, 3], [1, 1], [7, 7]):
        counts = [(p + n) // 4 - p // 4 for p, n in zip(starts, sizes, strict=True)]
        total = sum(sizes)
        rows = min(total, total // 4 + 2)
        cos = torch.zeros(rows, 64, dtype=torch.float64)
        sin = torch.zeros(rows, 64, dtype=torch.float64)
        at = 0
        for b in range(2):
            if counts[b]:
                cos[at:at + counts[b]], sin[at:at + counts[b]] = _rope_rows(module, starts[b] // 4, counts[b])
            at += counts[b]
        x = torch.cat([xs[b][0, starts[b]:starts[b] + sizes[b]] for b in range(2)])
        with torch.no_grad():
            out = compressor(x, *weights, sin, cos, 64, 4, state_block_table=table, coff=2, rotary_mode=2,
                             cu_seqlens=torch.tensor([0, sizes[0], total], dtype=torch.int32),
                             start_pos=torch.tensor(starts, dtype=torch.int32),
                             norm_eps=module.kv_norm.variance_epsilon)
        assert torch.isnan(out[sum(counts):]).all()
        got[0].append(out[:counts[0]])
        got[1].append(out[counts[0]:sum(counts)])
        starts = [p + n for p, n in zip(starts, sizes, strict=True)]
    for b in range(2):
        assert torch.allclose(torch.cat(got[b]), wants[b], rtol=1e-5, atol=1e-6), b


# ---------------------------------------------------------------- custom.npu_sparse_attn_sharedkv against transformers


def _paged(rows: torch.Tensor, block_size: int, gen: torch.Generator):
    """``rows [n, D]`` in a paged cache ``[blocks, block_size, 1, D]`` at shuffled block ids, and its table row."""
    n_blocks = -(-rows.shape[0] // block_size)
    ids = torch.randperm(n_blocks, generator=gen) + 1
    cache = torch.full((n_blocks + 1, block_size, 1, rows.shape[1]), float("nan"), dtype=rows.dtype)
    for p in range(rows.shape[0]):
        cache[ids[p // block_size], p % block_size, 0] = rows[p]
    return cache, ids.to(torch.int32)


def _oracle_attention(q, kv, cmp, visible_sets, sinks, scale):
    """transformers' eager_attention_forward (DeepSeek-V4's: one KV head broadcast to every query head, sinks as an
    extra logit column) over [window kv | compressed entries], the mask built from transformers' own rules: the
    sliding window of 128 keys ending at the query, and the compressed entries each query may see."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    s, n_kv = q.shape[0], kv.shape[0]
    keys = torch.cat([kv, cmp])[None, None]
    mask = torch.full((1, 1, s, keys.shape[2]), float("-inf"), dtype=q.dtype)
    for i in range(s):
        t = n_kv - s + i
        mask[0, 0, i, max(0, t - 127):t + 1] = 0
        for w in visible_sets[i]:
            mask[0, 0, i, n_kv + w] = 0
    stub = types.SimpleNamespace(num_key_value_groups=q.shape[1], sinks=sinks, training=False)
    out, _ = v4.eager_attention_forward(stub, q.permute(1, 0, 2)[None], keys, keys, mask, scale)
    return out[0]


@pytest.mark.parametrize("ratio, sparse", [(4, True), (128, False)])
def test_sparse_shared_kv_attention_matches_transformers_over_window_and_compressed_entries(ratio, sparse):
    """Two requests in one TND call (a prefill chunk and a decode step) over paged window and compressed caches at
    shuffled block ids: each request's output equals transformers' attention with its own keys and masks (CSA: the
    indexer's selection, -1 padded to 512; HCA: every causal entry)."""
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_sparse_attn_sharedkv

    gen = torch.Generator().manual_seed(3)
    # HCA: the decode query at 254 is the last that sees one entry fewer than its successor (a boundary)
    lengths, q_lens = ([150, 37], [6, 1]) if ratio == 4 else ([300, 255], [5, 1])
    sinks = torch.randn(64, dtype=torch.float64, generator=gen)
    scale = 512 ** -0.5
    qs, caches, wants, selections = [], [], [], []
    for n_kv, n_q in zip(lengths, q_lens, strict=True):
        kv = torch.randn(n_kv, 512, dtype=torch.float64, generator=gen)
        cmp = torch.randn(n_kv // ratio, 512, dtype=torch.float64, generator=gen)
        q = torch.randn(n_q, 64, 512, dtype=torch.float64, generator=gen)
        visible = [list(range((n_kv - n_q + i + 1) // ratio)) for i in range(n_q)]
        if sparse:  # the indexer keeps about half of what each query may see
            visible = [sorted(torch.randperm(len(v), generator=gen)[:max(1, len(v) // 2)].tolist()) for v in visible]
            selections += [v + [-1] * (512 - len(v)) for v in visible]
        qs.append(q)
        caches.append((_paged(kv, 16, gen), _paged(cmp, 16, gen)))
        wants.append(_oracle_attention(q, kv, cmp, visible, sinks, scale))
    width = max(len(c[0][1]) for c in caches), max(len(c[1][1]) for c in caches)
    ori_kv = torch.cat([caches[0][0][0], caches[1][0][0][1:]])  # one pool: request 1's blocks after request 0's
    cmp_kv = torch.cat([caches[0][1][0], caches[1][1][0][1:]])
    shift = caches[0][0][0].shape[0] - 1, caches[0][1][0].shape[0] - 1
    ori_table = torch.zeros(2, width[0], dtype=torch.int32)
    cmp_table = torch.zeros(2, width[1], dtype=torch.int32)
    for b in range(2):
        ori_table[b, :len(caches[b][0][1])] = caches[b][0][1] + (shift[0] if b else 0)
        cmp_table[b, :len(caches[b][1][1])] = caches[b][1][1] + (shift[1] if b else 0)
    out, _ = npu_sparse_attn_sharedkv(
        torch.cat(qs), ori_kv=ori_kv, cmp_kv=cmp_kv, ori_block_table=ori_table, cmp_block_table=cmp_table,
        cmp_sparse_indices=torch.tensor(selections, dtype=torch.int32)[:, None] if sparse else None,
        cu_seqlens_q=torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32),
        seqused_kv=torch.tensor(lengths, dtype=torch.int32), sinks=sinks,
        metadata=_metadata(q_lens, lengths, ratio, sparse), softmax_scale=scale, cmp_ratio=ratio, layout_q="TND")
    assert torch.allclose(out[:q_lens[0]], wants[0], atol=1e-12) and torch.allclose(out[q_lens[0]:], wants[1], atol=1e-12)


def _metadata(q_lens, kv_lens, ratio, sparse, **change):
    """npu_sparse_attn_sharedkv_metadata for a TND call, as upstream deepseek_v4 builds it per scene
    (calc_sas_metadata: cu_seqlens_q, seqused_kv, batch_size; c4a adds cmp_topk)."""
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_sparse_attn_sharedkv_metadata

    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = {"cu_seqlens_q": cu, "seqused_kv": torch.tensor(kv_lens, dtype=torch.int32), "batch_size": len(kv_lens),
              "cmp_ratio": ratio, "cmp_topk": 512 if sparse else 0, "layout_q": "TND", "has_cmp_kv": True, **change}
    return npu_sparse_attn_sharedkv_metadata(64, 1, 512, **kwargs)


def test_sparse_shared_kv_refuses_metadata_built_for_another_call():
    """Realistic mistakes: an HCA layer handed the CSA scene's metadata (upstream builds c1a / c4a / c128a per step),
    metadata kept from the previous step (its lengths), and a tensor no metadata op made: each refused by name, where
    the device would run the other call's task list."""
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_sparse_attn_sharedkv

    args = {"ori_kv": torch.zeros(3, 16, 1, 512, dtype=torch.float64), "cmp_kv": torch.zeros(2, 16, 1, 512,
            dtype=torch.float64), "ori_block_table": torch.tensor([[1, 2]], dtype=torch.int32),
            "cmp_block_table": torch.ones(1, 1, dtype=torch.int32), "cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32),
            "seqused_kv": torch.tensor([20], dtype=torch.int32), "softmax_scale": 0.04, "cmp_ratio": 128,
            "layout_q": "TND"}
    q = torch.zeros(1, 64, 512, dtype=torch.float64)
    out, _ = npu_sparse_attn_sharedkv(q, metadata=_metadata([1], [20], 128, False), **args)  # the right one
    assert torch.isfinite(out).all()
    for metadata, needle in ((_metadata([1], [20], 4, True), "built for cmp_ratio 4, this call has 128"),
                             (_metadata([1], [19], 128, False), "built for seqused_kv [19], this call has [20]"),
                             (torch.zeros(64, dtype=torch.int32), "not a result of")):
        with pytest.raises(NpuOpError, match=re.escape(needle)) as info:
            npu_sparse_attn_sharedkv(q, metadata=metadata, **args)
        assert info.value.argument == "metadata"


@pytest.mark.parametrize("change,argument", [
    ({"num_heads_q": 32}, "num_heads_q"),  # 目前仅支持64
    ({"cu_seqlens_ori_kv": torch.tensor([0, 9], dtype=torch.int32)}, "cu_seqlens_ori_kv"),  # 设置此参数无效
    ({"ori_topk": 64}, "ori_topk"),  # 目前暂不支持指定该参数
    ({"cmp_topk": 256}, "cmp_topk"),  # 目前仅支持512
    ({"cu_seqlens_q": None, "seqused_kv": None, "layout_q": "BSND"}, "cu_seqlens_q"),  # Tensor不能全传None
    ({"batch_size": 3}, "batch_size"),
    ({"cmp_ratio": 8}, "cmp_ratio"),
])
def test_sparse_shared_kv_metadata_refuses_what_its_doc_rules_out(change, argument):
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_sparse_attn_sharedkv_metadata

    kwargs = {"cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32), "seqused_kv": torch.tensor([9], dtype=torch.int32),
              "batch_size": 1, "cmp_ratio": 4, "cmp_topk": 512, "layout_q": "TND"}
    heads = change.pop("num_heads_q", 64)
    with pytest.raises(NpuOpError) as info:
        npu_sparse_attn_sharedkv_metadata(heads, 1, 512, **{**kwargs, **change})
    assert info.value.argument == argument, str(info.value)


def test_sparse_shared_kv_refuses_an_entry_the_query_may_not_see_and_what_its_doc_rules_out():
    """Negative controls: top-k over another request's entries or the future (an index past what the query may see)
    is refused by name; so are the arguments the doc rules out."""
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_sparse_attn_sharedkv

    args = {"ori_kv": torch.zeros(2, 16, 1, 512, dtype=torch.float64), "cmp_kv": torch.zeros(2, 16, 1, 512,
            dtype=torch.float64), "ori_block_table": torch.ones(1, 1, dtype=torch.int32),
            "cmp_block_table": torch.ones(1, 1, dtype=torch.int32), "cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32),
            "seqused_kv": torch.tensor([9], dtype=torch.int32), "metadata": _metadata([1], [9], 4, True),
            "softmax_scale": 0.04, "cmp_ratio": 4, "layout_q": "TND"}
    q = torch.zeros(1, 64, 512, dtype=torch.float64)
    future = torch.full((1, 1, 512), -1, dtype=torch.int32)
    future[0, 0, 0] = 2  # query at position 8 sees entries 0 and 1 only
    with pytest.raises(UnemulatedFeatureError, match="lists \\[2\\]"):
        npu_sparse_attn_sharedkv(q, cmp_sparse_indices=future, **args)
    for change, argument in (({"ori_win_left": 128}, "ori_win_left"), ({"softmax_scale": 0}, "softmax_scale"),
                             ({"metadata": None}, "metadata"), ({"return_softmax_lse": True}, "return_softmax_lse"),
                             ({"cmp_ratio": 8}, "cmp_ratio"), ({"seqused_q": torch.ones(1, dtype=torch.int32)},
                                                               "seqused_q")):
        with pytest.raises(NpuOpError) as info:
            npu_sparse_attn_sharedkv(q, **{**args, **change})
        assert info.value.argument == argument, (change, info.value)
    with pytest.raises(NpuOpError) as info:
        npu_sparse_attn_sharedkv(torch.zeros(1, 32, 512, dtype=torch.float64), **args)
    assert info.value.argument == "q"  # TND takes 64 query heads


# --------------------------------------------------------------------------- npu_moe_gating_top_k (V4's router)
def _v4_routers(experts: int = 16, top_k: int = 4, vocab: int = 50, seed: int = 3):
    """transformers' DeepseekV4TopKRouter and DeepseekV4HashRouter (sqrt(softplus) scores), float64, random weights,
    a random correction bias and a random token -> experts table."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

    config = DeepseekV4Config(hidden_size=32, num_local_experts=experts, num_experts_per_tok=top_k, vocab_size=vocab)
    g = torch.Generator().manual_seed(seed)
    top, hashed = DeepseekV4TopKRouter(config).double(), DeepseekV4HashRouter(config).double()
    with torch.no_grad():
        for router in (top, hashed):
            router.weight.copy_(torch.randn(router.weight.shape, generator=g, dtype=torch.float64))
        top.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.5)
        hashed.tid2eid.copy_(torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(vocab)]))
    return config, top, hashed


def test_gating_top_k_picks_and_weighs_as_transformers_v4_router():
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_moe_gating_top_k

    config, router, _ = _v4_routers()
    hidden = torch.randn(2, 5, 32, dtype=torch.float64)
    logits, want_w, want_idx = router(hidden)
    bias = router.e_score_correction_bias.double()
    w, idx, _ = npu_moe_gating_top_k(logits.view(2, 5, -1), config.num_experts_per_tok, bias=bias, norm_type=2,
                                     group_select_mode=1, routed_scaling_factor=config.routed_scaling_factor)
    assert w.shape == idx.shape == (2, 5, 4) and idx.dtype == torch.int32
    got = {tuple(sorted(zip(i.tolist(), x.tolist()))) for i, x in zip(idx.view(10, -1), w.view(10, -1))}
    ref = {tuple(sorted(zip(i.tolist(), x.tolist()))) for i, x in zip(want_idx, want_w)}
    assert len(got) == 10 and {tuple((e, round(v, 12)) for e, v in row) for row in got} == \
        {tuple((e, round(v, 12)) for e, v in row) for row in ref}
    # the bias steers the choice (a run without it picks other experts) and stays out of the weights (the doc
    # formula's literal reading, weights from normOut + bias, differs from transformers by far more than rounding)
    _, plain, _ = npu_moe_gating_top_k(logits, 4, norm_type=2, group_select_mode=1)
    assert not torch.equal(plain.sort(-1).values, idx.view(10, -1).sort(-1).values)
    scores = torch.nn.functional.softplus(logits).sqrt()
    literal = (scores + bias).gather(1, idx.view(10, -1).long())
    literal = literal / literal.sum(-1, keepdim=True) * config.routed_scaling_factor
    assert (literal - w.view(10, -1)).abs().max() > 1e-3


def test_gating_top_k_hash_routes_by_the_token_table_as_transformers():
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_moe_gating_top_k

    config, _, router = _v4_routers()
    hidden = torch.randn(7, 32, dtype=torch.float64)
    ids = torch.randint(0, config.vocab_size, (7,))
    logits, want_w, want_idx = router(hidden, ids)
    w, idx, _ = npu_moe_gating_top_k(logits, 4, input_ids=ids, tid2eid=router.tid2eid.int(), norm_type=2,
                                     routed_scaling_factor=config.routed_scaling_factor)
    assert torch.equal(idx.long(), want_idx) and (w - want_w).abs().max() <= 1e-12


def test_gating_top_k_groups_as_torch_npus_op_does():
    # the grouped selection is one function for both operators; softmax scores, max-scored groups
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_moe_gating_top_k
    from model_infer_kvcache.validators.npu_ops.moe import npu_moe_gating_top_k as torch_npu_op

    x = torch.randn(6, 32, dtype=torch.float64)
    bias = torch.randn(32, dtype=torch.float64) * 0.1
    w, idx, _ = npu_moe_gating_top_k(x, 4, bias=bias, k_group=2, group_count=4, norm_type=1)
    w_ref, idx_ref, _ = torch_npu_op(x, 4, bias=bias, k_group=2, group_count=4, norm_type=1)
    assert torch.equal(idx, idx_ref) and (w - w_ref).abs().max() <= 1e-15
    groups = (idx.long() // 8)  # every pick from the two best-scored groups of four
    assert all(len(set(row.tolist())) <= 2 for row in groups)


@pytest.mark.parametrize("change,error,field", [
    ({"k": 65}, NpuOpError, "k"),  # k <= 64
    ({"renorm": 1}, NpuOpError, "renorm"),  # renorm仅支持0
    ({"norm_type": 3}, NpuOpError, "norm_type"),
    ({"tid2eid": "table"}, NpuOpError, "input_ids"),  # 不允许只有一个为空
    ({"bias": "float32"}, NpuOpError, "bias"),  # bias的dtype要和x相同
    ({"input_ids": "out_of_table", "tid2eid": "table"}, NpuOpError, "input_ids"),
    ({"out_flag": True, "bias": "same"}, UnemulatedFeatureError, "out_flag"),
    ({"group_count": 3}, NpuOpError, "group_count"),
])
def test_gating_top_k_refuses_what_its_doc_rules_out(change, error, field):
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_moe_gating_top_k

    x = torch.randn(4, 128, dtype=torch.float64)
    values = {"table": torch.randint(0, 128, (10, 4), dtype=torch.int32), "float32": torch.zeros(128),
              "same": torch.zeros(128, dtype=torch.float64), "out_of_table": torch.tensor([0, 1, 2, 10])}
    kwargs = {"k": 4, **{k: values.get(v, v) if isinstance(v, str) else v for k, v in change.items()}}
    with pytest.raises(error) as err:
        npu_moe_gating_top_k(x, kwargs.pop("k"), **kwargs)
    assert err.value.argument == field, str(err.value)


# --------------------------------------------------------------------------- npu_hc_pre / npu_hc_post (mHC)
def _hyper_connection(seed: int = 5):
    """transformers' DeepseekV4HyperConnection at the docs' fixed shape (hc 4, d 4096), float64, random weights."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    config = DeepseekV4Config(hidden_size=4096, hc_mult=4)
    hc = DeepseekV4HyperConnection(config).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g, dtype=torch.float64) * 0.02)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g, dtype=torch.float64) * 0.5)
        hc.scale.copy_(torch.rand(3, generator=g, dtype=torch.float64) + 0.5)
    return config, hc


def test_hc_pre_collapses_the_streams_as_transformers_hyper_connection():
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_hc_pre

    config, hc = _hyper_connection()
    from model_infer_kvcache.validators.pipeline.precision import float64_upcasts

    streams = torch.randn(2, 3, 4, 4096, dtype=torch.float64)
    with float64_upcasts():  # its .float() upcasts keep float64, as in every validation run
        want_post, want_comb, want_y = hc(streams)
    y, post, comb = npu_hc_pre(streams, hc.fn.detach(), hc.scale.detach(), hc.base.detach(),
                               norm_eps=config.rms_norm_eps, hc_eps=config.hc_eps)
    assert y.shape == (2, 3, 4096) and post.shape == (2, 3, 4) and comb.shape == (2, 3, 4, 4)
    for got, want in ((y, want_y), (post, want_post), (comb, want_comb)):
        assert (got - want).abs().max() <= 1e-12
    # doubly stochastic after the Sinkhorn iterations, and not symmetric: the direction of the mix matters
    assert (comb.sum(-1) - 1).abs().max() < 1e-3 and (comb.sum(-2) - 1).abs().max() < 1e-5
    assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-3
    y_flat, _, _ = npu_hc_pre(streams.view(6, 4, 4096), hc.fn.detach(), hc.scale.detach(), hc.base.detach(),
                              norm_eps=config.rms_norm_eps, hc_eps=config.hc_eps)
    assert torch.equal(y_flat, y.view(6, 4096))  # the [T, hc, d] form: the same rows


def test_hc_post_expands_and_mixes_as_transformers_decoder_layer():
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_hc_post, npu_hc_pre

    config, hc = _hyper_connection()
    streams = torch.randn(2, 3, 4, 4096, dtype=torch.float64)
    _, post, comb = npu_hc_pre(streams, hc.fn.detach(), hc.scale.detach(), hc.base.detach(),
                               norm_eps=config.rms_norm_eps, hc_eps=config.hc_eps)
    layer_out = torch.randn(2, 3, 4096, dtype=torch.float64)
    got = npu_hc_post(layer_out, streams, post, comb)
    # DeepseekV4DecoderLayer: post * out + comb^T @ streams
    want = post.unsqueeze(-1) * layer_out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    assert got.shape == streams.shape and (got - want).abs().max() <= 1e-12
    untransposed = post.unsqueeze(-1) * layer_out.unsqueeze(-2) + torch.matmul(comb, streams)
    assert (untransposed - got).abs().max() > 1e-3  # the other contraction is a different model


@pytest.mark.parametrize("case,error,field", [
    ("pre_d", NpuOpError, "x"),  # d 固定为 4096
    ("pre_iters", NpuOpError, "hc_sinkhorn_iters"),  # 取值固定为 20
    ("pre_fn", NpuOpError, "hc_fn"),  # [hc_mix, hc * d]
    ("post_flat", UnemulatedFeatureError, "x"),  # the [T, ...] form's dim=2 is comb's other axis
    ("post_dtype", NpuOpError, "residual"),  # x、residual和y的dtype要保持一致
])
def test_hc_ops_refuse_what_their_docs_rule_out(case, error, field):
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_hc_post, npu_hc_pre

    fn, scale, base = torch.zeros(24, 16384, dtype=torch.float64), torch.ones(3, dtype=torch.float64), \
        torch.zeros(24, dtype=torch.float64)
    streams = torch.zeros(1, 2, 4, 4096, dtype=torch.float64)
    post, comb = torch.full((1, 2, 4), 0.5, dtype=torch.float64), torch.full((1, 2, 4, 4), 0.25, dtype=torch.float64)
    calls = {
        "pre_d": lambda: npu_hc_pre(torch.zeros(1, 2, 4, 512, dtype=torch.float64), fn, scale, base),
        "pre_iters": lambda: npu_hc_pre(streams, fn, scale, base, hc_sinkhorn_iters=10),
        "pre_fn": lambda: npu_hc_pre(streams, fn[:, :4096].contiguous(), scale, base),
        "post_flat": lambda: npu_hc_post(torch.zeros(2, 4096, dtype=torch.float64), streams.view(2, 4, 4096),
                                         post.view(2, 4), comb.view(2, 4, 4)),
        "post_dtype": lambda: npu_hc_post(torch.zeros(1, 2, 4096, dtype=torch.float64), streams.float(), post, comb),
    }
    with pytest.raises(error) as err:
        calls[case]()
    assert err.value.argument == field, str(err.value)
