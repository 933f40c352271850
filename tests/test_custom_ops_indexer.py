"""DeepSeek-V4's quantized lightning indexer, its metadata and indexer_compress_epilog, emulated from their docs
(validators/npu_ops/custom_ops.py, issue 38).

The indexer is compared with transformers' own DeepseekV4Indexer (its scorer, causal threshold and top-k) fed the
int8-quantized queries and compressed keys dequantized, through a paged cache written as upstream deepseek_v4's int8
path writes it (scatter_nd_update_asc at block_id * block_size + offset), two requests in one TND call. Three
realistic mistakes (an off-by-one causal threshold, a wrong block table row, another request's keys) each break the
comparison; every documented argument rule has a call that breaks it.
"""

from __future__ import annotations

import re

import pytest
import torch
from model_infer_kvcache.validators.npu_ops import custom_ops
from model_infer_kvcache.validators.npu_ops.custom_ops import (
    indexer_compress_epilog,
    npu_quant_lightning_indexer,
    npu_quant_lightning_indexer_metadata,
    scatter_nd_update_asc,
)
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError

HEADS, DIM, RATIO, BLOCK = 64, 128, 4, 16
TOPK = 24
# (ORIGINAL key tokens, queries): a prefill chunk whose early queries see fewer than TOPK entries (-1 padded) and
# whose late ones see more (entries dropped), and a decode step; each fills two blocks of compressed keys
REQUESTS = ((128, 44), (128, 1))


def _dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization (torch_npu npu_dynamic_quant's formula: scale = rowMax(|x|) / 127,
    y = round(x / scale)), the scale kept as float16 as upstream deepseek_v4 keeps it."""
    scale = (x.abs().amax(dim=-1) / 127).to(torch.float16)
    q = torch.round(x / scale.to(x.dtype)[..., None]).clamp(-128, 127).to(torch.int8)
    return q, scale


class _Fixed(torch.nn.Module):
    """A projection that returns given rows (the scorer's weights_proj, pinned to the weights the op is fed)."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out = out

    def forward(self, _hidden):
        return self.out


def _indexer():
    """transformers' DeepseekV4Indexer at the kernel's heads (64) and head dim (128), float64, every weight random."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    torch.manual_seed(0)
    config = DeepseekV4Config(hidden_size=64, head_dim=64, qk_rope_head_dim=32, num_attention_heads=4,
                              num_key_value_heads=1, q_lora_rank=32, index_n_heads=HEADS, index_head_dim=DIM,
                              index_topk=TOPK, num_hidden_layers=2, vocab_size=64)
    module = v4.DeepseekV4Indexer(config).double().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    assert module.compress_rate == RATIO
    return module


def _request(module, n: int, q_len: int, gen: torch.Generator) -> dict:
    """One request of ``n`` tokens: what upstream's int8 path feeds the op for its last ``q_len`` tokens (q and the
    compressed keys quantized per token-head, W = weights_proj * softmax_scale * n_heads^-0.5 in float16), and what
    transformers' indexer selects for them when its scorer sees exactly those quantized values dequantized."""
    hidden = torch.randn(1, n, 64, dtype=torch.float64, generator=gen)
    q_res = torch.randn(1, n, 32, dtype=torch.float64, generator=gen)
    positions = torch.arange(n)[None]
    seen = {}
    hook = module.scorer.register_forward_hook(lambda _m, args, _o: seen.update(q=args[0], k=args[1]))
    with torch.no_grad():
        module(hidden, q_res, positions, None, 0)
    hook.remove()
    q8, q_scale = _dynamic_quant(seen["q"][0])  # [n, 64, 128], [n, 64]
    k8, k_scale = _dynamic_quant(seen["k"][0])  # [n // 4, 128], [n // 4]
    scorer = module.scorer
    weights = (scorer.weights_proj(hidden)[0] * scorer.softmax_scale * scorer.weights_scaling).to(torch.float16)
    original_proj, original_forward = scorer.weights_proj, scorer.forward
    # the oracle: transformers' scorer + causal threshold + top-k, its inputs the dequantized int8 values and its
    # head weights the float16 W (its softmax_scale and weights_scaling divided out: they multiply back in)
    scorer.weights_proj = _Fixed(weights.double() / (scorer.softmax_scale * scorer.weights_scaling))
    scorer.forward = lambda _q, _k, h: original_forward(
        (q8.double() * q_scale.double()[..., None])[None], (k8.double() * k_scale.double()[..., None])[None], h)
    try:
        with torch.no_grad():
            want = module(hidden, q_res, positions, None, 0)[0, n - q_len:]
    finally:
        scorer.weights_proj = original_proj
        del scorer.forward
        assert scorer.forward == original_forward
    want = torch.cat([want, torch.full((q_len, TOPK - want.shape[1]), -1, dtype=want.dtype)], dim=1)
    return {"q": q8[n - q_len:], "q_scale": q_scale[n - q_len:], "w": weights[n - q_len:], "k": k8,
            "k_scale": k_scale, "want": want.to(torch.int32)}


@pytest.fixture(scope="module")
def batch():
    """Both requests' operands, and their compressed keys written into one paged pool at shuffled block ids as
    upstream's int8 path writes li_cmp_kv / li_key_dequant_scale (scatter_nd_update_asc over rows block * 16 +
    offset; unwritten slots keep a NaN scale, so reading one shows up)."""
    module = _indexer()
    gen = torch.Generator().manual_seed(7)
    reqs = [_request(module, n, q_len, gen) for n, q_len in REQUESTS]
    blocks = 6
    ids = torch.randperm(blocks, generator=gen).to(torch.int32)
    table = torch.stack([ids[:2], ids[2:4]])
    li_cmp_kv = torch.zeros(blocks, BLOCK, 1, DIM, dtype=torch.int8)
    li_scale = torch.full((blocks, BLOCK, 1, 1), float("nan"), dtype=torch.float16)
    for b, req in enumerate(reqs):
        entries = torch.arange(req["k"].shape[0])
        slots = (table[b].long()[entries // BLOCK] * BLOCK + entries % BLOCK).to(torch.int32).view(-1, 1)
        scatter_nd_update_asc(li_scale.view(-1, 1), slots, req["k_scale"].view(-1, 1))
        scatter_nd_update_asc(li_cmp_kv.view(-1, DIM), slots, req["k"].view(-1, DIM))
    return reqs, li_cmp_kv, li_scale, table


def _call(batch, *, table=None, key_lens=None, **change):
    """The op called as upstream's forward_li_quant calls it (TND queries, PA_BSND keys, sparse_mode 3, cmp_ratio 4,
    key_dequant_scale = the scale cache squeezed), with the metadata calc_li_metadata builds."""
    reqs, li_cmp_kv, li_scale, own_table = batch
    q_cu = torch.tensor([REQUESTS[0][1], REQUESTS[0][1] + REQUESTS[1][1]], dtype=torch.int32)
    k_lens = torch.tensor([n for n, _ in REQUESTS] if key_lens is None else key_lens, dtype=torch.int32)
    metadata = npu_quant_lightning_indexer_metadata(
        HEADS, 1, DIM, 0, 0, actual_seq_lengths_query=q_cu, actual_seq_lengths_key=k_lens, layout_query="TND",
        layout_key="PA_BSND", sparse_count=TOPK, sparse_mode=3, cmp_ratio=RATIO)
    kwargs = {"actual_seq_lengths_query": q_cu, "actual_seq_lengths_key": k_lens, "metadata": metadata,
              "block_table": own_table if table is None else table, "layout_key": "PA_BSND", "sparse_count": TOPK,
              "sparse_mode": 3, "layout_query": "TND", "cmp_ratio": RATIO, "key_quant_mode": 0,
              "query_quant_mode": 0, **change}
    out, values = npu_quant_lightning_indexer(
        torch.cat([r["q"] for r in reqs]), li_cmp_kv, torch.cat([r["w"] for r in reqs]),
        torch.cat([r["q_scale"] for r in reqs]), li_scale.squeeze(-2), **kwargs)
    return out, values


def _matches(batch, out) -> bool:
    """Each query's selected set (and its count of -1) equals transformers' (the order is checked apart: transformers'
    scorer runs in float32, where two close scores may swap; the set's boundary is far from a tie, see below)."""
    want = torch.cat([r["want"] for r in batch[0]])
    return torch.equal(out[:, 0].sort(dim=-1).values, want.sort(dim=-1).values)


def _doc_scores(req) -> torch.Tensor:
    """The doc's formula in float64 for one request's queries: sum_h W ReLU((Scale_Q Scale_K^T) (Q K^T))."""
    dots = req["q"].double() @ req["k"].double().T  # [q, 64, entries]
    scale = req["q_scale"].double()[..., None] * req["k_scale"].double()
    return (req["w"].double()[..., None] * (scale * dots).relu()).sum(dim=1)


def test_two_requests_in_one_call_select_what_transformers_indexer_selects(batch):
    out, values = _call(batch)
    assert out.dtype == torch.int32 and tuple(out.shape) == (sum(q for _, q in REQUESTS), 1, TOPK)
    assert _matches(batch, out)
    rows = out[:, 0].split([q for _, q in REQUESTS])
    for (n, q_len), req, got in zip(REQUESTS, batch[0], rows, strict=True):
        scores = _doc_scores(req)
        for i in range(q_len):
            visible = (n - q_len + i + 1) // RATIO
            ranked = scores[i, :visible].sort(descending=True).values
            picked = got[i][got[i] >= 0].long()
            assert torch.equal(scores[i, picked], ranked[:TOPK])  # by descending score
            if visible > TOPK:  # the cut is no near-tie: float32 rounding cannot move it
                assert (ranked[TOPK - 1] - ranked[TOPK]) > 1e-6 * ranked.abs().max()
    early = out[0, 0]  # the chunk's first query (t 84) sees 21 entries: its row is -1 padded after them
    assert (early[:21] >= 0).all() and (early[21:] == -1).all()
    assert (out[-1, 0] >= 0).all()  # the decode step (t 127) sees 32 entries and keeps TOPK of them
    assert values.shape == out.shape and values.isnan().all()  # sparse_values: 目前暂不支持


@pytest.mark.parametrize("threshold", [lambda t, m: (t + 2) // m, lambda t, m: t // m])
def test_an_off_by_one_causal_threshold_breaks_the_comparison(batch, monkeypatch, threshold):
    monkeypatch.setattr(custom_ops, "_visible_entries", threshold)
    assert not _matches(batch, _call(batch)[0])


def test_a_wrong_block_table_row_breaks_the_comparison(batch):
    table = batch[3].clone()
    table[0] = table[0].flip(0)  # request 0's two blocks in the wrong order (both written, no NaN to trip on)
    assert not _matches(batch, _call(batch, table=table)[0])


def test_reading_another_requests_keys_breaks_the_comparison(batch):
    assert not _matches(batch, _call(batch, table=batch[3].flip(0).contiguous())[0])  # the rows swapped


def test_a_block_never_written_is_refused_not_read(batch):
    """A table naming a block nobody wrote (a stale or freed block): its scales are NaN, and the doc leaves NaN in
    the top-k undefined, so the call is refused by name instead of selecting from garbage."""
    table = batch[3].clone()
    table[1, 1] = next(b for b in range(6) if b not in batch[3].flatten().tolist())
    with pytest.raises(UnemulatedFeatureError, match="NaN score"):
        _call(batch, table=table)


def test_metadata_built_for_another_call_is_refused(batch):
    """Realistic mistakes: the previous step's metadata (its key lengths), another top-k's, the attention's
    metadata, a tensor no metadata op made; each refused by name where the device would run the other call's
    task list. No metadata at all is allowed (the argument is optional)."""
    from model_infer_kvcache.validators.npu_ops.custom_ops import npu_sparse_attn_sharedkv_metadata

    q_cu = torch.tensor([44, 45], dtype=torch.int32)

    def meta(k_lens=(128, 128), **change):
        kwargs = {"actual_seq_lengths_query": q_cu, "actual_seq_lengths_key": torch.tensor(k_lens, dtype=torch.int32),
                  "layout_query": "TND", "layout_key": "PA_BSND", "sparse_count": TOPK, "sparse_mode": 3,
                  "cmp_ratio": RATIO, **change}
        return npu_quant_lightning_indexer_metadata(HEADS, 1, DIM, 0, 0, **kwargs)

    sharedkv = npu_sparse_attn_sharedkv_metadata(64, 1, 512, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                                                 seqused_kv=torch.tensor([9], dtype=torch.int32), batch_size=1,
                                                 cmp_ratio=4, cmp_topk=512, layout_q="TND", has_cmp_kv=True)
    for metadata, needle in ((meta((127, 128)), "built for other actual_seq_lengths_key"),
                             (meta(sparse_count=TOPK + 1), f"built for sparse_count {TOPK + 1}, this call has {TOPK}"),
                             (meta(max_seqlen_k=127, k_lens=(127, 127)), "built for max_seqlen_k 127"),
                             (sharedkv, "not a result of"), (torch.zeros(1024, dtype=torch.int32), "not a result of")):
        with pytest.raises(NpuOpError, match=re.escape(needle)) as info:
            _call(batch, metadata=metadata)
        assert info.value.argument == "metadata"
    assert _matches(batch, _call(batch, metadata=None)[0])


# ------------------------------------------------------------------------------------------ argument rules refused


def _small(**change):
    """One request (2 queries over 12 key tokens: 3 compressed entries in block 1), TND; ``change`` overrides."""
    gen = torch.Generator().manual_seed(1)
    args = {"query": torch.randint(-128, 128, (2, HEADS, DIM), dtype=torch.int8, generator=gen),
            "key": torch.randint(-128, 128, (2, BLOCK, 1, DIM), dtype=torch.int8, generator=gen),
            "weights": torch.rand(2, HEADS, generator=gen).to(torch.float16),
            "query_dequant_scale": torch.rand(2, HEADS, generator=gen).to(torch.float16),
            "key_dequant_scale": torch.rand(2, BLOCK, 1, generator=gen).to(torch.float16),
            "actual_seq_lengths_query": torch.tensor([2], dtype=torch.int32),
            "actual_seq_lengths_key": torch.tensor([12], dtype=torch.int32),
            "block_table": torch.tensor([[1]], dtype=torch.int32), "layout_query": "TND", "layout_key": "PA_BSND",
            "sparse_count": 4, "sparse_mode": 3, "cmp_ratio": RATIO}
    args.update(change)
    return args


def test_the_small_call_is_accepted_and_bsnd_matches_tnd():
    tnd, _ = npu_quant_lightning_indexer(**_small())
    assert sorted(tnd[0, 0, :2].tolist()) == [0, 1] and tnd[0, 0, 2:].tolist() == [-1, -1]  # t 10 sees 2 entries
    assert sorted(tnd[1, 0, :3].tolist()) == [0, 1, 2] and tnd[1, 0, 3] == -1  # t 11 sees 3
    args = _small(layout_query="BSND", actual_seq_lengths_query=None)
    for name in ("query", "weights", "query_dequant_scale"):
        args[name] = args[name].unsqueeze(0).contiguous()
    bsnd, _ = npu_quant_lightning_indexer(**args)
    assert tuple(bsnd.shape) == (1, 2, 1, 4) and torch.equal(bsnd[0], tnd)


def test_equal_scores_rank_by_entry_and_sparse_mode_0_sees_every_entry():
    """The doc fixes no tie order: equal scores come by ascending entry (a deterministic reading, device_questions.md);
    defaultMask (sparse_mode 0) lets every query see all of its request's entries."""
    args = _small()
    args["key"][1, :3] = args["key"][1, 0]  # entries 0..2 identical, their scales too
    args["key_dequant_scale"][1, :3] = args["key_dequant_scale"][1, 0]
    out, _ = npu_quant_lightning_indexer(**args)
    assert out[:, 0].tolist() == [[0, 1, -1, -1], [0, 1, 2, -1]]
    out, _ = npu_quant_lightning_indexer(**{**args, "sparse_mode": 0})
    assert out[:, 0].tolist() == [[0, 1, 2, -1], [0, 1, 2, -1]]


@pytest.mark.parametrize("change, argument", [
    ({"query": torch.zeros(2, HEADS, DIM, dtype=torch.float16)}, "query"),  # int8 only
    ({"query": torch.zeros(2, 32, DIM, dtype=torch.int8)}, "query"),  # N1 仅支持64
    ({"query": torch.zeros(2, HEADS, 64, dtype=torch.int8)}, "query"),  # D 为128
    ({"query": torch.zeros(HEADS, 2, DIM, dtype=torch.int8).transpose(0, 1)}, "query"),  # 不支持非连续
    ({"key": torch.zeros(2, BLOCK, 1, DIM, dtype=torch.float16)}, "key"),
    ({"key": torch.zeros(2, BLOCK, 2, DIM, dtype=torch.int8)}, "key"),  # N2 1 (its metadata: 目前仅支持1)
    ({"key": torch.zeros(2, 24, 1, DIM, dtype=torch.int8)}, "key"),  # block_size 16 的整数倍
    ({"weights": torch.zeros(2, HEADS, dtype=torch.float32)}, "weights"),  # float16 only
    ({"weights": torch.zeros(3, HEADS, dtype=torch.float16)}, "weights"),  # [T, N1]
    ({"weights": torch.full((2, HEADS), 300.0, dtype=torch.float16),
      "query_dequant_scale": torch.full((2, HEADS), 300.0, dtype=torch.float16)}, "weights"),  # W⊙Scale_Q > fp16
    ({"query_dequant_scale": torch.zeros(2, HEADS, dtype=torch.bfloat16)}, "query_dequant_scale"),
    ({"key_dequant_scale": torch.zeros(2, BLOCK, dtype=torch.float16)}, "key_dequant_scale"),  # [blocks, bs, N2]
    ({"key_dequant_scale": torch.zeros(3, BLOCK, 1, dtype=torch.float16)}, "key_dequant_scale"),
    ({"layout_key": "BSND"}, "layout_key"),  # 当前仅支持传入PA_BSND (the signature's default included)
    ({"layout_query": "BSH"}, "layout_query"),
    ({"sparse_count": 0}, "sparse_count"), ({"sparse_count": 2049}, "sparse_count"),  # 支持[1, 2048]
    ({"sparse_mode": 1}, "sparse_mode"),  # 支持0/3
    ({"pre_tokens": 1024}, "pre_tokens"), ({"next_tokens": 0}, "next_tokens"),  # 仅支持默认值
    ({"cmp_ratio": 3}, "cmp_ratio"), ({"cmp_ratio": 256}, "cmp_ratio"),  # 1/2/4/8/16/32/64/128
    ({"return_value": True}, "return_value"),  # 仅支持默认值False
    ({"query_quant_mode": 1}, "query_quant_mode"), ({"key_quant_mode": 2}, "key_quant_mode"),  # 仅支持传入0
    ({"actual_seq_lengths_query": None}, "actual_seq_lengths_query"),  # TND: 必须传入
    ({"actual_seq_lengths_query": torch.tensor([2], dtype=torch.int64)}, "actual_seq_lengths_query"),  # int32
    ({"actual_seq_lengths_query": torch.tensor([2, 1], dtype=torch.int32)}, "actual_seq_lengths_query"),  # 前缀和
    ({"actual_seq_lengths_query": torch.tensor([3], dtype=torch.int32)}, "actual_seq_lengths_query"),  # past T1
    ({"actual_seq_lengths_key": None}, "actual_seq_lengths_key"),  # PA_BSND: 必须传入
    ({"actual_seq_lengths_key": torch.tensor([-4], dtype=torch.int32)}, "actual_seq_lengths_key"),
    ({"actual_seq_lengths_key": torch.tensor([1], dtype=torch.int32)}, "actual_seq_lengths_key"),  # < its queries
    ({"actual_seq_lengths_key": torch.tensor([68], dtype=torch.int32)}, "block_table"),  # 17 entries: 2 blocks
    ({"block_table": None}, "block_table"),
    ({"block_table": torch.tensor([[1]], dtype=torch.int64)}, "block_table"),
    ({"block_table": torch.tensor([[2]], dtype=torch.int32)}, "block_table"),  # no block 2
    ({"block_table": torch.tensor([[1], [0]], dtype=torch.int32)}, "block_table"),  # 第一维长度需要等于B
    ({"metadata": torch.zeros(1024, dtype=torch.int32)}, "metadata"),
])
def test_the_indexer_refuses_what_its_doc_rules_out(change, argument):
    with pytest.raises(NpuOpError) as info:
        npu_quant_lightning_indexer(**_small(**change))
    assert info.value.argument == argument, str(info.value)


@pytest.mark.parametrize("change, argument", [
    ({"num_heads_q": 32}, "num_heads_q"),  # 目前仅支持64
    ({"num_heads_k": 2}, "num_heads_k"),  # 目前仅支持1
    ({"head_dim": 0}, "head_dim"),
    ({"query_quant_mode": 1}, "query_quant_mode"), ({"key_quant_mode": 1}, "key_quant_mode"),  # 仅支持传入0
    ({"layout_key": "BSND"}, "layout_key"),  # 仅支持默认值PA_BSND (the signature's default is 'BSND')
    ({"layout_query": "SBH"}, "layout_query"),
    ({"sparse_count": 4096}, "sparse_count"), ({"sparse_mode": 2}, "sparse_mode"), ({"cmp_ratio": 5}, "cmp_ratio"),
    ({"pre_tokens": 7}, "pre_tokens"), ({"next_tokens": 7}, "next_tokens"),
    ({"actual_seq_lengths_query": None, "actual_seq_lengths_key": None, "layout_query": "BSND"},
     "actual_seq_lengths_key"),  # Tensor不能全传None
    ({"actual_seq_lengths_query": None}, "actual_seq_lengths_query"),  # TND: 必须传入
    ({"actual_seq_lengths_key": None}, "actual_seq_lengths_key"),  # PA_BSND: 必须传入
    ({"actual_seq_lengths_query": torch.tensor([5, 3], dtype=torch.int32)}, "actual_seq_lengths_query"),  # 前缀和
    ({"actual_seq_lengths_key": torch.tensor([20.0, 9.0])}, "actual_seq_lengths_key"),  # int32
    ({"batch_size": 3}, "batch_size"),
    ({"max_seqlen_k": 9}, "max_seqlen_k"),  # not the largest key count (20)
    ({"max_seqlen_q": 5}, "max_seqlen_q"),  # TND: the largest per-request count is 3
    ({"device": 0}, "device"),
])
def test_the_metadata_refuses_what_its_doc_rules_out(change, argument):
    kwargs = {"num_heads_q": HEADS, "num_heads_k": 1, "head_dim": DIM, "query_quant_mode": 0, "key_quant_mode": 0,
              "actual_seq_lengths_query": torch.tensor([3, 5], dtype=torch.int32),
              "actual_seq_lengths_key": torch.tensor([20, 9], dtype=torch.int32), "layout_query": "TND",
              "layout_key": "PA_BSND", "sparse_count": 512, "sparse_mode": 3, "cmp_ratio": RATIO, **change}
    with pytest.raises(NpuOpError) as info:
        npu_quant_lightning_indexer_metadata(**kwargs)
    assert info.value.argument == argument, str(info.value)


def test_the_metadata_is_a_1024_int32_tensor_and_takes_the_defaults_upstream_leaves():
    """Upstream's calc_li_metadata passes neither batch_size nor max_seqlen_*: 0 means "not given"; the values the
    doc's example passes (the largest counts) are accepted too."""
    lens = {"actual_seq_lengths_query": torch.tensor([3, 5], dtype=torch.int32),
            "actual_seq_lengths_key": torch.tensor([20, 9], dtype=torch.int32)}
    kwargs = {"layout_query": "TND", "layout_key": "PA_BSND", "sparse_count": 512, "cmp_ratio": RATIO, **lens}
    plain = npu_quant_lightning_indexer_metadata(HEADS, 1, DIM, 0, 0, **kwargs)
    given = npu_quant_lightning_indexer_metadata(HEADS, 1, DIM, 0, 0, batch_size=2, max_seqlen_q=3, max_seqlen_k=20,
                                                 **kwargs)
    assert plain.dtype == torch.int32 and tuple(plain.shape) == (1024,) and tuple(given.shape) == (1024,)


# --------------------------------------------------------------------------------------------- indexer_compress_epilog


def _epilog_operands(cache_dtype, rows: int = 5, slots: int = 8):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(rows, 4096, generator=gen) * torch.logspace(-2, 2, 32).repeat_interleave(128)).to(torch.bfloat16)
    cache = torch.full((slots, 4096), -2.0).to(cache_dtype)  # a sentinel the op must leave where it writes nothing
    scale = torch.full((slots, 32), -1.0)
    return x, cache, scale


@pytest.mark.parametrize("cache_dtype, error", [(torch.float8_e4m3fn, 2 ** -4), (torch.float8_e5m2, 2 ** -3)])
def test_the_epilog_quantizes_per_128_and_writes_the_mapped_slots(cache_dtype, error):
    """Each row whose slot is not -1 lands, quantized per 128 lanes, at its slot; its float32 scale is the group's
    absmax over the dtype's largest value, value * scale is the row within the fp8 rounding; -1 writes nowhere."""
    x, cache, scale = _epilog_operands(cache_dtype)
    slot_mapping = torch.tensor([3, -1, 0, 6, -1], dtype=torch.int32)
    indexer_compress_epilog(cache, scale, x, slot_mapping)
    for row, slot in ((0, 3), (2, 0), (3, 6)):
        groups = x[row].float().view(32, 128)
        absmax = groups.abs().amax(-1)
        assert torch.equal(scale[slot], absmax / torch.finfo(cache_dtype).max)
        dequant = cache[slot].float().view(32, 128) * scale[slot][:, None]
        assert ((dequant - groups).abs() <= error * absmax[:, None]).all()
    untouched = [1, 2, 4, 5, 7]
    assert (cache[untouched].float() == -2.0).all() and (scale[untouched] == -1.0).all()


def test_upstreams_float8_call_with_the_indexers_128_wide_keys_is_refused_by_name():
    """Upstream deepseek_v4's float8 path (compressor.update_compress_cache) hands the op the indexer's keys
    ``x [T, 128]`` and the 4-D caches ``li_cmp_kv [blocks, bs, 1, 128]`` / ``li_key_dequant_scale [blocks, bs, 1, 1]``;
    the doc fixes d at 4096 (scale_factor 32) and 2-D operands, so both forms are refused by name rather than read
    one way (references/device_questions.md). Its int8 path writes through scatter_nd_update_asc (the indexer test's
    cache is written that way)."""
    x = torch.randn(4, 128).to(torch.bfloat16)
    slots = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    cache = torch.zeros(2, 16, 1, 128).to(torch.float8_e4m3fn)
    scale = torch.zeros(2, 16, 1, 1)
    with pytest.raises(NpuOpError) as info:
        indexer_compress_epilog(indexer_compress_cache=cache, indexer_compress_scale=scale, x=x, slot_mapping=slots)
    assert info.value.argument == "indexer_compress_cache"
    with pytest.raises(NpuOpError) as info:
        indexer_compress_epilog(indexer_compress_cache=cache.view(-1, 128), indexer_compress_scale=scale.view(-1, 1),
                                x=x, slot_mapping=slots)
    assert info.value.argument == "x" and "4096" in str(info.value)


def _epilog_case(name):
    x, cache, scale = _epilog_operands(torch.float8_e4m3fn)
    slots = torch.tensor([3, -1, 0, 6, -1], dtype=torch.int32)
    args = {"indexer_compress_cache": cache, "indexer_compress_scale": scale, "x": x, "slot_mapping": slots}
    changes = {
        "cache_dtype": {"indexer_compress_cache": cache.to(torch.float16)},
        "cache_3d": {"indexer_compress_cache": cache.view(8, 1, 4096)},
        "cache_width": {"indexer_compress_cache": torch.zeros(8, 2048).to(torch.float8_e4m3fn)},
        "scale_dtype": {"indexer_compress_scale": scale.to(torch.float16)},
        "scale_e8m0_mode1": {"indexer_compress_scale": scale.abs().to(torch.float8_e8m0fnu)},
        "scale_width": {"indexer_compress_scale": torch.zeros(8, 16)},
        "x_dtype": {"x": x.float()},
        "x_width": {"x": torch.randn(5, 2048).to(torch.bfloat16)},
        "x_noncontiguous": {"x": torch.randn(4096, 5).to(torch.bfloat16).T},
        "slot_dtype": {"slot_mapping": slots.long()},
        "slot_below": {"slot_mapping": torch.tensor([3, -2, 0, 6, -1], dtype=torch.int32)},
        "slot_past": {"slot_mapping": torch.tensor([3, 8, 0, 6, -1], dtype=torch.int32)},
        "slot_count": {"slot_mapping": slots[:4].contiguous()},
        "slot_twice": {"slot_mapping": torch.tensor([3, -1, 3, 6, -1], dtype=torch.int32)},
        "zero_group": {"x": x.clone().index_fill_(1, torch.arange(128, 256), 0)},
        "mx": {"quant_mode": 0},
        "hifloat8": {"quant_mode": 2},  # upstream's HIFLOAT_QUANT_MODE: not in the doc (取值范围0或1)
        "round_scale": {"round_scale": 1},
    }
    return {**args, **changes[name]}


@pytest.mark.parametrize("case, argument, error", [
    ("cache_dtype", "indexer_compress_cache", NpuOpError),  # float8_e4m3fn / float8_e5m2
    ("cache_3d", "indexer_compress_cache", NpuOpError),  # shape [T, d]
    ("cache_width", "indexer_compress_cache", NpuOpError),
    ("scale_dtype", "indexer_compress_scale", NpuOpError),  # float / float8_e8m0
    ("scale_e8m0_mode1", "indexer_compress_scale", NpuOpError),  # quant_mode 1: float32
    ("scale_width", "indexer_compress_scale", NpuOpError),  # scale_factor 固定为32
    ("x_dtype", "x", NpuOpError),  # float16 / bfloat16
    ("x_width", "x", NpuOpError),  # d 取值固定为4096
    ("x_noncontiguous", "x", NpuOpError),  # 不支持非连续
    ("slot_dtype", "slot_mapping", NpuOpError),  # int32
    ("slot_below", "slot_mapping", NpuOpError),  # 取值范围为[-1, T)
    ("slot_past", "slot_mapping", NpuOpError),
    ("slot_count", "slot_mapping", NpuOpError),  # shape [T]
    ("slot_twice", "slot_mapping", UnemulatedFeatureError),  # which write lands: the doc does not say
    ("zero_group", "x", UnemulatedFeatureError),  # scale 0: 0 / 0 undefined by the doc
    ("mx", "quant_mode", UnemulatedFeatureError),  # documented, its e8m0 rule and round_scale not given
    ("hifloat8", "quant_mode", NpuOpError),
    ("round_scale", "round_scale", NpuOpError),
])
def test_the_epilog_refuses_what_its_doc_rules_out(case, argument, error):
    args = _epilog_case(case)
    before = args["indexer_compress_cache"].clone()
    with pytest.raises(error) as info:
        indexer_compress_epilog(**args)
    assert info.value.argument == argument, str(info.value)
    assert torch.equal(before.float(), args["indexer_compress_cache"].float())  # a refused call writes nothing
