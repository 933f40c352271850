"""DSA operators: npu_lightning_indexer's selection and npu_sparse_flash_attention's attention over it, against
independent dense references (transformers' DeepseekV32 formulation: scores, top-k, an additive mask)."""

from __future__ import annotations

import pytest
import torch
from model_infer_kvcache.validators.npu_ops.emulated import OPS
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError

LI, SFA = OPS["npu_lightning_indexer"], OPS["npu_sparse_flash_attention"]
I32 = torch.int32


def _paged(rows_per_request: list[torch.Tensor], block_size: int, n_blocks: int, seed: int = 0):
    """Requests' rows ``[S_b, N, D]`` scattered into shuffled blocks: (cache [blocks, bs, N, D], table)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_blocks - 1, generator=g) + 1  # block 0 stays unused (the null block)
    n, d = rows_per_request[0].shape[1:]
    cache = torch.full((n_blocks, block_size, n, d), float("nan"))
    need = max(-(-r.shape[0] // block_size) for r in rows_per_request)
    table = torch.zeros(len(rows_per_request), need, dtype=I32)
    used = 0
    for b, rows in enumerate(rows_per_request):
        for j in range(-(-rows.shape[0] // block_size)):
            blk = int(order[used])
            used += 1
            table[b, j] = blk
            chunk = rows[j * block_size:(j + 1) * block_size]
            cache[blk, :chunk.shape[0]] = chunk
    return cache, table


def _reference_topk(q, k, w, q_len, kv_len, topk):
    """transformers' DeepseekV32Indexer: scores with its positive factors, causal mask, top-k (sets per row)."""
    scale = q.shape[-1] ** -0.5 * q.shape[1] ** -0.5
    scores = torch.einsum("shd,td->sht", q.double(), k.double()).relu()
    index = torch.einsum("sh,sht->st", w.double() * scale, scores)
    pos = kv_len - q_len + torch.arange(q_len)
    index = index.masked_fill(torch.arange(kv_len).view(1, -1) > pos.view(-1, 1), float("-inf"))
    top = index.topk(min(topk, kv_len), dim=-1)
    return [{i for i, v in zip(ti.tolist(), tv.tolist(), strict=True) if v != float("-inf")}
            for ti, tv in zip(top.indices, top.values, strict=True)]


def _case(seed=0, q_lens=(5, 1, 3), kv_lens=(9, 20, 3), heads=4, dim=16, block_size=4):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, 1, dim, generator=g) for n in kv_lens]
    q = torch.randn(sum(q_lens), heads, dim, generator=g)
    w = torch.randn(sum(q_lens), heads, generator=g)
    cache, table = _paged(keys, block_size, 16, seed)
    cu_q = torch.tensor(q_lens, dtype=I32).cumsum(0).to(I32)
    return keys, q, w, cache, table, cu_q, torch.tensor(kv_lens, dtype=I32)


@pytest.mark.parametrize("topk", [1, 4, 8, 64])
def test_indexer_selects_what_transformers_selects(topk):
    q_lens, kv_lens = (5, 1, 3), (9, 20, 3)
    keys, q, w, cache, table, cu_q, kv = _case(q_lens=q_lens, kv_lens=kv_lens)
    out, values = LI(q, cache, w, actual_seq_lengths_query=cu_q, actual_seq_lengths_key=kv, block_table=table,
                     layout_query="TND", layout_key="PA_BSND", sparse_count=topk, sparse_mode=3)
    assert out.shape == (sum(q_lens), 1, topk) and out.dtype == I32 and values.numel() == 0
    start = 0
    for b, (s1, s2) in enumerate(zip(q_lens, kv_lens, strict=True)):
        want = _reference_topk(q[start:start + s1], keys[b][:, 0], w[start:start + s1], s1, s2, topk)
        for i in range(s1):
            row = out[start + i, 0].tolist()
            valid = [x for x in row if x != -1]
            assert set(valid) == want[i], (b, i)
            assert row == valid + [-1] * (topk - len(valid))  # valid first, then -1
        start += s1


def test_indexer_orders_by_score_and_mode_0_sees_every_key():
    keys, q, w, cache, table, cu_q, kv = _case(q_lens=(2,), kv_lens=(6,))
    causal, _ = LI(q, cache, w, actual_seq_lengths_query=cu_q, actual_seq_lengths_key=kv, block_table=table,
                   layout_query="TND", layout_key="PA_BSND", sparse_count=6, sparse_mode=3)
    full, _ = LI(q, cache, w, actual_seq_lengths_query=cu_q, actual_seq_lengths_key=kv, block_table=table,
                 layout_query="TND", layout_key="PA_BSND", sparse_count=6, sparse_mode=0)
    assert (causal[0, 0] == -1).sum() == 1 and (causal[1, 0] == -1).sum() == 0  # query 0 sees keys 0..4
    assert sorted(full[0, 0].tolist()) == list(range(6))
    scores = torch.einsum("hd,td->ht", q[1], keys[0][:, 0]).relu().mul(w[1].view(-1, 1)).sum(0)
    assert full[1, 0].tolist() == scores.argsort(descending=True).tolist()


def test_sparse_attention_over_all_causal_keys_is_dense_causal_attention():
    """Every causal key selected: the MLA absorb call (latent + rope, key is value) equals plain attention."""
    g = torch.Generator().manual_seed(1)
    q_lens, kv_lens, heads, d, dr = (3, 1), (7, 5), 4, 32, 8
    latent = [torch.randn(n, 1, d, generator=g) for n in kv_lens]
    rope = [torch.randn(n, 1, dr, generator=g) for n in kv_lens]
    nope_cache, table = _paged(latent, 4, 12, seed=3)
    rope_cache, table2 = _paged(rope, 4, 12, seed=3)
    assert torch.equal(table, table2)
    q, qr = torch.randn(sum(q_lens), heads, d, generator=g), torch.randn(sum(q_lens), heads, dr, generator=g)
    width = 8
    idx = torch.full((sum(q_lens), 1, width), -1, dtype=I32)
    start = 0
    for s1, s2 in zip(q_lens, kv_lens, strict=True):
        for i in range(s1):
            visible = list(range(s2 - s1 + i + 1))
            idx[start + i, 0, :len(visible)] = torch.tensor(visible[::-1], dtype=I32)  # any order
        start += s1
    out, mx, sm = SFA(q, nope_cache, nope_cache, idx, 0.3, block_table=table,
                      actual_seq_lengths_query=torch.tensor(q_lens, dtype=I32).cumsum(0).to(I32),
                      actual_seq_lengths_kv=torch.tensor(kv_lens, dtype=I32), query_rope=qr, key_rope=rope_cache,
                      layout_query="TND", layout_kv="PA_BSND", sparse_mode=3, attention_mode=2)
    assert out.shape == q.shape and mx.numel() == 0 and sm.numel() == 0
    start = 0
    for b, (s1, s2) in enumerate(zip(q_lens, kv_lens, strict=True)):
        k, r = latent[b][:, 0].double(), rope[b][:, 0].double()
        s = (torch.einsum("shd,td->sht", q[start:start + s1].double(), k)
             + torch.einsum("shd,td->sht", qr[start:start + s1].double(), r)) * 0.3
        pos = s2 - s1 + torch.arange(s1)
        s = s.masked_fill((torch.arange(s2).view(1, 1, -1) > pos.view(-1, 1, 1)), float("-inf"))
        want = torch.einsum("sht,td->shd", s.softmax(-1), k)
        torch.testing.assert_close(out[start:start + s1].double(), want, atol=1e-5, rtol=1e-5)
        start += s1


def test_indexer_then_sparse_attention_equals_the_masked_dense_reference():
    """The pair as a model calls it (top-k selection, then attention over it) equals transformers' way (the
    top-k scattered into an additive mask over dense attention), and differs from dense attention: keys dropped."""
    q_lens, kv_lens, topk = (6, 1), (24, 30), 5
    keys, q, w, cache, table, cu_q, kv = _case(seed=0, q_lens=q_lens, kv_lens=kv_lens, heads=4, dim=16)
    idx, _ = LI(q, cache, w, actual_seq_lengths_query=cu_q, actual_seq_lengths_key=kv, block_table=table,
                layout_query="TND", layout_key="PA_BSND", sparse_count=topk, sparse_mode=3)
    g = torch.Generator().manual_seed(9)
    latent = [torch.randn(n, 1, 16, generator=g) for n in kv_lens]
    lat_cache, lat_table = _paged(latent, 4, 16, seed=0)
    assert torch.equal(lat_table, table)
    qa = torch.randn(sum(q_lens), 2, 16, generator=g)
    out, _, _ = SFA(qa, lat_cache, lat_cache, idx, 0.25, block_table=table, actual_seq_lengths_query=cu_q,
                    actual_seq_lengths_kv=kv, layout_query="TND", layout_kv="PA_BSND", sparse_mode=3)
    start, dropped = 0, 0
    for b, (s1, s2) in enumerate(zip(q_lens, kv_lens, strict=True)):
        sel = _reference_topk(q[start:start + s1], keys[b][:, 0], w[start:start + s1], s1, s2, topk)
        k = latent[b][:, 0].double()
        s = torch.einsum("shd,td->sht", qa[start:start + s1].double(), k) * 0.25
        mask = torch.full((s1, s2), float("-inf"), dtype=torch.float64)
        for i, chosen in enumerate(sel):
            mask[i, list(chosen)] = 0
            dropped += s2 - s1 + i + 1 - len(chosen)
        want = torch.einsum("sht,td->shd", (s + mask.view(s1, 1, s2)).softmax(-1), k)
        torch.testing.assert_close(out[start:start + s1].double(), want, atol=1e-5, rtol=1e-5)
        start += s1
    assert dropped > 0


def _li_kwargs(**over):
    keys, q, w, cache, table, cu_q, kv = _case()
    kw = dict(query=q, key=cache, weights=w, actual_seq_lengths_query=cu_q, actual_seq_lengths_key=kv,
              block_table=table, layout_query="TND", layout_key="PA_BSND", sparse_count=4, sparse_mode=3)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over, error, words", [
    ({"actual_seq_lengths_query": None}, NpuOpError, "required when layout_query is TND"),
    ({"block_table": None}, NpuOpError, "block_table"),
    ({"actual_seq_lengths_key": None}, NpuOpError, "actual_seq_lengths_key"),
    ({"sparse_count": 0}, NpuOpError, "sparse_count"),
    ({"sparse_count": 2049}, NpuOpError, "sparse_count"),
    ({"sparse_mode": 1}, NpuOpError, "sparse_mode"),
    ({"actual_seq_lengths_key": torch.tensor([9, 20, 3])}, NpuOpError, "int64"),
    ({"actual_seq_lengths_query": torch.tensor([5, 1, 9], dtype=I32)}, NpuOpError, "prefix sums"),
    ({"layout_key": "BSND"}, NpuOpError, "layout_key"),
    ({"return_value": True}, UnemulatedFeatureError, "return_value"),
    ({"pre_tokens": 128}, UnemulatedFeatureError, "pre_tokens"),
])
def test_indexer_refuses_what_the_doc_does_not_allow(over, error, words):
    with pytest.raises(error, match=words):
        LI(**_li_kwargs(**over))


def _sfa_args(idx=None, **over):
    g = torch.Generator().manual_seed(2)
    cache, table = _paged([torch.randn(6, 1, 8, generator=g)], 4, 4)
    q = torch.randn(2, 2, 8, generator=g)
    idx = torch.tensor([[[0, 1, -1]], [[2, 5, 4]]], dtype=I32) if idx is None else idx
    kw = dict(block_table=table, actual_seq_lengths_query=torch.tensor([2], dtype=I32),
              actual_seq_lengths_kv=torch.tensor([6], dtype=I32), layout_query="TND", layout_kv="PA_BSND",
              sparse_mode=3)
    kw.update(over)
    return (q, cache, cache, idx, 0.5), kw


@pytest.mark.parametrize("idx, over, error, words", [
    (torch.tensor([[[0, -1, 1]], [[2, 5, 4]]], dtype=I32), {}, NpuOpError, "valid index follows an invalid"),
    (torch.tensor([[[0, 6, -1]], [[2, 5, 4]]], dtype=I32), {}, NpuOpError, "index 6 is outside its 6 keys"),
    (torch.tensor([[[0, 1, -1]], [[2, 5, 4]]]), {}, NpuOpError, "sparse_indices"),
    (None, {"sparse_block_size": 2}, UnemulatedFeatureError, "sparse_block_size"),
    (None, {"return_softmax_lse": True}, UnemulatedFeatureError, "return_softmax_lse"),
    (None, {"block_table": None}, NpuOpError, "block_table"),
    (None, {"sparse_mode": 4}, NpuOpError, "sparse_mode"),
])
def test_sparse_attention_refuses_what_the_doc_does_not_allow(idx, over, error, words):
    args, kw = _sfa_args(idx, **over)
    with pytest.raises(error, match=words):
        SFA(*args, **kw)


def test_sparse_attention_mla_mode_takes_key_and_value_as_one_tensor():
    (q, cache, _, idx, scale), kw = _sfa_args()
    with pytest.raises(NpuOpError, match="one tensor"):
        SFA(q, cache, cache.clone(), idx, scale, attention_mode=2, **kw)
    SFA(q, cache, cache, idx, scale, attention_mode=2, **kw)


def test_a_key_selected_past_the_query_is_masked_under_mode_3():
    """Query 0 of a 2-token prefill over 6 keys sees keys 0..4: a selected key 5 does not count under mode 3."""
    (q, cache, _, _, scale), kw = _sfa_args()
    with_5 = torch.tensor([[[0, 5, -1]], [[0, -1, -1]]], dtype=I32)
    without = torch.tensor([[[0, -1, -1]], [[0, -1, -1]]], dtype=I32)
    a, _, _ = SFA(q, cache, cache, with_5, scale, **kw)
    b, _, _ = SFA(q, cache, cache, without, scale, **kw)
    torch.testing.assert_close(a, b)
    kw["sparse_mode"] = 0
    c, _, _ = SFA(q, cache, cache, with_5, scale, **kw)
    assert not torch.allclose(a[0], c[0])
