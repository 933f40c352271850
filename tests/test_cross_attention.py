"""The cross-attention kind (issue #40): the decoder of an encoder-decoder model keeps one slot per request for the
K/V of its encoder states (analyzer/kinds/cross.py, kv_cache_spec.CrossAttentionSpec, templates/kinds/
cross_attention.py.j2, validators/kinds/cross.py). Analyzer tests at published sizes; the render of both modes."""

from __future__ import annotations

import json

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.kv_cache_spec import CROSS_ATTENTION, MAMBA, CrossAttentionSpec
from model_infer_kvcache.implementer.render import render_manifest
from validators_support import CONFIGS

FRAMEWORK, STANDALONE = "部署模式：框架部署", "部署模式：独立部署"


def _plan(config: str, dispatch: str = FRAMEWORK, **over):
    return analyze(AnalyzeRequest(config=str(CONFIGS / config), dispatch=dispatch, **over))


def test_bart_plans_a_slot_per_request_sized_by_the_shared_position_table():
    m = _plan("bart_large.json")
    x = m.cross_attention
    assert x.layers == list(range(12)) and x.module_attr == "encoder_attn"
    assert x.max_encoder_len == 1024 and x.max_encoder_len_source.startswith("max_position_embeddings")
    assert (x.num_kv_heads_per_rank, x.head_dim, x.slot_tokens, x.slot_block_size) == (16, 64, 1024, 128)
    # K and V of 1024 positions x 16 heads x 64 in bfloat16, plus the int32 length, per layer
    assert x.slot_bytes_per_layer == 2 * 1024 * 16 * 64 * 2 + 4 and x.slot_bytes == 12 * x.slot_bytes_per_layer
    group = next(g for g in m.memory.groups if g.group_key == CROSS_ATTENTION)
    assert group.fixed_blocks and group.state_bytes == x.slot_bytes
    assert all(layer.attn_type == "FullAttention" for layer in m.layers)  # the self-attention keeps the paged cache


def test_whisper_sizes_the_slot_by_max_source_positions():
    x = _plan("whisper_tiny.json").cross_attention
    assert x.max_encoder_len == 1500 and x.max_encoder_len_source.startswith("max_source_positions")
    assert x.slot_tokens == 1536 and len(x.layers) == 4


def test_trocr_without_an_encoder_length_is_blocked_by_name():
    m = _plan("trocr_large.json")
    assert m.cross_attention is None
    assert any("max_source_positions" in b.message and "cross-attention slot" in b.message for b in m.blockers)


def test_the_spec_reserves_one_slot_per_request_in_the_mamba_manager():
    spec = CrossAttentionSpec(CROSS_ATTENTION, 1000, 0, 12, slot_tokens=1024)
    assert spec.manager == MAMBA and spec.fixed and spec.state and spec.per_token_bytes == 0
    assert spec.fixed_blocks(4) == 5 and spec.blocks_per_request(10 ** 6) == 1
    assert "5 cross-attention slots" in spec.fixed_formula(4)


def test_an_analyzer_that_ignores_the_cross_attention_is_refused_by_the_cross_check(monkeypatch):
    # the realistic mistake: the encoder-decoder config read as decoder-only (no cross facts)
    monkeypatch.setattr(cross_kind, "read_facts", lambda get, cfg: None)
    with pytest.raises(InputError, match="hold a cross-attention module .* and the analyzer plans none"):
        _plan("bart_large.json")


@pytest.mark.parametrize("dispatch", [FRAMEWORK, STANDALONE])
def test_both_modes_render_the_slot(dispatch):
    files = render_manifest(_plan("bart_large.json", dispatch)).files
    attention = files["kvcache_attention.py"]
    assert "def init_cross_cache(" in attention and "sparse_mode=0" in attention and "atten_mask=None" in attention
    if dispatch == FRAMEWORK:
        assert 'manager_key=self.attn_type' in attention and 'block_table[self.attn_type][:requests, 0]' in attention
    else:
        assert "cross_slots=index.to(torch.int32)" in files["kvcache_runner.py"]
