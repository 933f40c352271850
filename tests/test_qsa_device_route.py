"""Qwen4-Exp's QSA on the pinned torch_npu ops (issue 40): why its refusal is a kvcache gap, not a device one.

transformers' Qwen4ExpTextQSAIndexer._select_tokens scores, per query, the complete blocks of
``indexer_compress_ratio`` raw indexer keys (their float mean, k_layernorm'd, RoPE'd at the block's first position)
by ``sum_h relu(q_h . k) / sqrt(indexer_head_dim)``, keeps the top ``indexer_budget / indexer_compress_ratio`` blocks
plus the incomplete tail block, and masks Qwen4ExpTextAttention's GQA softmax to those tokens. The route below does
the same with kvcache's emulation of the ops as their docs state them (torch_npu 2.14.0 ``_op_plugin_docs.py``):
``npu_lightning_indexer`` (:1371) over a paged cache of pooled block keys, one query per TND batch row with its own
visible-block count (as kvcache already calls it for DeepSeek-V4's CSA: templates/kinds/compressed_attention.py.j2
``select_entries``), weights ``indexer_head_dim ** -0.5`` on every head; then ``npu_sparse_flash_attention``
(:1474) over the paged K / V caches (two KV heads, no rope split) with each query's selected blocks expanded to
their tokens and its tail, valid indices first. Prefill rows and a decode step match transformers' attention to
its float32 softmax's rounding (3.4e-7); the mistakes a render could make (pooled keys rotated at the block's last
position, the tail dropped, a block counted visible before its last token: 1.8 to 6.5) do not. kvcache plans none of it yet (the analyzer refuses
qwen4_exp_text with the gap: analyzer/config_loader.py NON_MLA_INDEXERS)."""

from __future__ import annotations

import pytest
import torch
from model_infer_kvcache.validators.npu_ops.sparse_attention import (
    npu_lightning_indexer,
    npu_sparse_flash_attention,
)

RATIO, BUDGET, BLOCK = 4, 8, 8  # QSA: 2 blocks of 4 tokens kept per query; paged caches of 8 rows a block
TOKENS = 41  # 10 complete blocks and a tail of 1: most blocks are left out of the late queries' selection


def _attention():
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (
        Qwen4ExpTextAttention,
        Qwen4ExpTextRotaryEmbedding,
    )

    config = Qwen4ExpTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=BUDGET,
        indexer_compress_ratio=RATIO, num_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = Qwen4ExpTextAttention(config, layer_idx=3).double().eval()
    with torch.no_grad():  # the (1 + w) norms start at w = 0: random weights exercise them
        for p in attn.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 0.2)
    rope = Qwen4ExpTextRotaryEmbedding(config)
    hidden = torch.randn(1, TOKENS, 64, dtype=torch.float64)
    cos, sin = rope(hidden, torch.arange(TOKENS).view(1, 1, -1))
    return attn, hidden, cos, sin


def _reference(attn, hidden, cos, sin) -> torch.Tensor:
    causal = torch.full((TOKENS, TOKENS), torch.finfo(hidden.dtype).min, dtype=hidden.dtype).triu(1)
    with torch.no_grad():
        out, _ = attn(hidden, (cos, sin), attention_mask=causal.view(1, 1, TOKENS, TOKENS), cache=None)
    return out[0]


def _paged(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [S, N, D] in a paged cache [blocks, BLOCK, N, D] whose blocks are laid out in reverse, and its table."""
    blocks = -(-rows.shape[0] // BLOCK)
    cache = rows.new_zeros(blocks, BLOCK, *rows.shape[1:])
    table = torch.arange(blocks - 1, -1, -1, dtype=torch.int32).view(1, -1)
    slots = table[0].long()[torch.arange(rows.shape[0]) // BLOCK] * BLOCK + torch.arange(rows.shape[0]) % BLOCK
    cache.view(-1, *rows.shape[1:])[slots] = rows
    return cache, table


def _device(attn, hidden, cos, sin, queries: slice, *, key_at: str = "first", tail: bool = True,
            visible_shift: int = 0) -> torch.Tensor:
    """Attention output rows ``queries`` through the pinned ops (the keyword arguments: the mistakes)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    ix, x, cos, sin = attn.indexer, hidden[0], cos[0], sin[0]
    heads, dim = ix.index_n_heads, ix.index_head_dim
    with torch.no_grad():
        iq, raw = ix.index_qk_proj(x).split([heads * dim, dim], dim=-1)
        iq = apply_rotary_pos_emb(ix.q_layernorm(iq.view(TOKENS, heads, dim)), cos=cos, sin=sin)
        # one pooled key per complete block, written when the block's last token arrives
        blocks = TOKENS // RATIO
        pooled = ix.k_layernorm(raw[: blocks * RATIO].view(blocks, RATIO, dim).float().mean(1).to(raw.dtype))
        at = torch.arange(blocks) * RATIO + (0 if key_at == "first" else RATIO - 1)
        pooled = apply_rotary_pos_emb(pooled.unsqueeze(1), cos=cos[at], sin=sin[at])  # [blocks, 1, dim]
        pooled_cache, pooled_table = _paged(pooled)

        q_rows = torch.arange(TOKENS)[queries]
        n = q_rows.numel()
        visible = ((q_rows + 1 + visible_shift) // RATIO).clamp(max=blocks)
        top, _ = npu_lightning_indexer(
            iq[q_rows].contiguous(), pooled_cache, torch.full((n, heads), dim ** -0.5, dtype=x.dtype),
            actual_seq_lengths_query=torch.arange(1, n + 1, dtype=torch.int32),
            actual_seq_lengths_key=visible.to(torch.int32), block_table=pooled_table.expand(n, -1).contiguous(),
            layout_query="TND", layout_key="PA_BSND", sparse_count=BUDGET // RATIO, sparse_mode=3)
        top = top.view(n, -1).long()
        # the selected blocks' tokens, then the tail block's, valid first (the sparse FA doc's order)
        tokens = torch.where(top.unsqueeze(-1) >= 0, top.unsqueeze(-1) * RATIO + torch.arange(RATIO), -1).view(n, -1)
        tail_at = (q_rows + 1) // RATIO * RATIO
        tails = tail_at.view(-1, 1) + torch.arange(RATIO - 1)
        tails = torch.where((tails <= q_rows.view(-1, 1)) & tail, tails, -1)
        picked = torch.cat([tokens, tails], dim=-1)
        picked = picked.gather(-1, (picked < 0).to(torch.int8).argsort(dim=-1, stable=True))

        kv_heads, head_dim = attn.config.num_key_value_heads, attn.head_dim
        query, gate = attn.q_proj(x).view(TOKENS, -1, 2 * head_dim).chunk(2, dim=-1)
        query = attn.q_norm(query)
        key = attn.k_norm(attn.k_proj(x).view(TOKENS, kv_heads, head_dim))
        value = attn.v_proj(x).view(TOKENS, kv_heads, head_dim)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        key_cache, table = _paged(key)
        value_cache, _ = _paged(value)
        out, _, _ = npu_sparse_flash_attention(
            query[q_rows].contiguous(), key_cache, value_cache,
            picked.to(torch.int32).unsqueeze(1).expand(n, kv_heads, -1).contiguous(), head_dim ** -0.5,
            block_table=table, actual_seq_lengths_query=torch.tensor([n], dtype=torch.int32),
            actual_seq_lengths_kv=torch.tensor([int(q_rows[-1]) + 1], dtype=torch.int32),
            layout_query="TND", layout_kv="PA_BSND", sparse_mode=3)
        out = out.reshape(n, -1) * torch.sigmoid(gate[q_rows].reshape(n, -1))
        return attn.o_proj(out)


@pytest.fixture(scope="module")
def case():
    attn, hidden, cos, sin = _attention()
    return attn, hidden, cos, sin, _reference(attn, hidden, cos, sin)


@pytest.mark.parametrize("queries", [slice(0, TOKENS), slice(TOKENS - 1, TOKENS)], ids=["prefill", "decode"])
def test_qsa_on_the_pinned_ops_matches_transformers(case, queries):
    attn, hidden, cos, sin, want = case
    got = _device(attn, hidden, cos, sin, queries)
    # eager_attention_forward takes its softmax in float32 whatever the dtype: float32 rounding, not float64's
    assert (got - want[queries]).abs().max() < 1e-6


@pytest.mark.parametrize("mistake", [{"key_at": "last"}, {"tail": False}, {"visible_shift": 1}],
                         ids=["pooled-key-rope-at-last-token", "tail-dropped", "block-visible-early"])
def test_a_qsa_route_mistake_does_not_match(case, mistake):
    attn, hidden, cos, sin, want = case
    got = _device(attn, hidden, cos, sin, slice(0, TOKENS), **mistake)
    assert (got - want).abs().max() > 1e-3
