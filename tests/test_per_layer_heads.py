"""Per-layer attention shapes (issue 23, Gemma-4): transformers' ``per_layer_config`` and the published
``global_head_dim`` / ``num_global_key_value_heads`` give the full-attention layers their own head_dim and KV
heads; the analyzer plans each layer's caches with them, counts them, splits them by TP, and refuses what it
cannot plan per layer. The config is transformers' own Gemma4TextConfig with the public gemma-4-26B-A4B values
(upstream models/gemma_4 README and agentic/progress.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import saved_config
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.implementer.render import render_manifest

transformers = pytest.importorskip("transformers")

# google/gemma-4-26B-A4B, text decoder (public values; the config class fills the rest)
GEMMA4_26B = dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=256, sliding_window=1024, final_logit_softcapping=30.0,
                  max_position_embeddings=262144, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                  num_global_key_value_heads=2, global_head_dim=512, enable_moe_block=True, num_experts=128,
                  top_k_experts=8, moe_intermediate_size=704)


def gemma4_26b_config(tmp: Path, **changes) -> Path:
    """Gemma4TextConfig(**GEMMA4_26B) as saved by transformers (per_layer_config), then ``changes``."""
    return saved_config(transformers.Gemma4TextConfig(**GEMMA4_26B), tmp, "gemma4_26b", **changes)


def _full(m: SelectionManifest) -> list[int]:
    return [layer.index for layer in m.layers if layer.attn_type == "FullAttention"]


def test_full_layers_get_their_own_head_dim_and_kv_heads(tmp_path):
    m = analyze(AnalyzeRequest(config=str(gemma4_26b_config(tmp_path))))
    assert not m.blockers and m.kv_mode.value == "paged"
    assert _full(m) == [5, 11, 17, 23, 29]
    for layer in m.layers:
        full = layer.index in _full(m)
        want = (512, 2) if full else (256, 8)
        assert [(c.dim, c.num_head) for c in layer.caches] == [want, want], layer.index
        # only the differing layers carry the fields (the model's values elsewhere)
        assert (layer.head_dim, layer.num_kv_heads_per_rank) == ((512, 2) if full else (None, None))
    # memory: 25 sliding layers x 2 x 8 x 256 + 5 full layers x 2 x 2 x 512, bfloat16
    assert m.memory.per_token_bytes == (25 * 2 * 8 * 256 + 5 * 2 * 2 * 512) * 2
    dumped = m.model_dump(mode="json")
    assert "head_dim" not in dumped["layers"][0] and dumped["layers"][5]["head_dim"] == 512
    assert SelectionManifest.model_validate(dumped) == m  # round trip


def test_the_published_global_fields_give_the_same_plan(tmp_path):
    """A config.json written without per_layer_config (the hub's spelling) names global_head_dim and
    num_global_key_value_heads; the latter applies only with attention_k_eq_v (Gemma4TextConfig's rule)."""
    via_map = analyze(AnalyzeRequest(config=str(gemma4_26b_config(tmp_path))))
    hub = gemma4_26b_config(tmp_path, per_layer_config=None, global_head_dim=512, num_global_key_value_heads=2)
    assert [lay.caches for lay in analyze(AnalyzeRequest(config=str(hub))).layers] == \
        [lay.caches for lay in via_map.layers]
    # the fixture in the hub's key names, without layer_types (Gemma4TextConfig's pattern: every 6th layer and
    # the last one full)
    fixture = Path(__file__).parent / "fixtures" / "configs" / "gemma4_26b_a4b.json"
    assert [lay.caches for lay in analyze(AnalyzeRequest(config=str(fixture))).layers] == \
        [lay.caches for lay in via_map.layers]
    no_keqv = gemma4_26b_config(tmp_path, per_layer_config=None, global_head_dim=512, num_global_key_value_heads=2,
                                attention_k_eq_v=False)
    full = analyze(AnalyzeRequest(config=str(no_keqv))).layers[5]
    assert [(c.dim, c.num_head) for c in full.caches] == [(512, 8), (512, 8)]


def test_the_decisions_table_names_the_layers_with_their_own_cache_shape(tmp_path):
    """The table the user confirms shows the full layers' caches beside the model's (it showed layer 0's only)."""
    from model_infer_kvcache.analyzer.decisions_table import decision_rows

    m = analyze(AnalyzeRequest(config=str(gemma4_26b_config(tmp_path))))
    row = next(r for r in decision_rows(m) if r[0] == "cache_entries")
    assert row[1] == ("k_cache: 256x8 bfloat16, v_cache: 256x8 bfloat16; 层 5,11,17,23,29: k_cache: 512x2 bfloat16, "
                      "v_cache: 512x2 bfloat16")


def test_attention_tp_splits_each_layers_kv_heads(tmp_path):
    m = analyze(AnalyzeRequest(config=str(gemma4_26b_config(tmp_path)), attn_tp_size=2))
    assert m.parallel.num_kv_heads_per_rank == 4
    assert [(c.dim, c.num_head) for c in m.layers[5].caches] == [(512, 1), (512, 1)]
    assert m.layers[5].num_kv_heads_per_rank == 1 and m.layers[0].num_kv_heads_per_rank is None
    # TP 4: the full layers' 2 KV heads are replicated (4 is a multiple of 2); TP 3 divides neither count
    assert analyze(AnalyzeRequest(config=str(gemma4_26b_config(tmp_path)), attn_tp_size=4)).layers[5].caches[0].num_head == 1
    with pytest.raises(InputError, match="not divisible by attn_tp_size 3"):
        analyze(AnalyzeRequest(config=str(gemma4_26b_config(tmp_path)), attn_tp_size=3))


@pytest.mark.parametrize("override, message", [
    ({"05": {"head_dim": 512, "sliding_window": 4096}}, "overrides sliding_window on layer 5"),
    ({"05": {"num_attention_heads": 8}}, "overrides num_attention_heads on layer 5"),
    ({"40": {"head_dim": 512}}, "key '40' is not a layer index below num_hidden_layers 30"),
    ({"x": {"head_dim": 512}}, "key 'x' is not a layer index"),
    ({"05": 512}, "must map to an object"),
    ({"05": {"num_key_value_heads": 3}}, "16 query heads are not a multiple of 3 KV heads"),
    ({"05": {"head_dim": True}}, "per_layer_config.05.head_dim"),
])
def test_per_layer_overrides_kvcache_cannot_plan_are_refused_by_name(tmp_path, override, message):
    path = gemma4_26b_config(tmp_path, per_layer_config=override)
    with pytest.raises(InputError, match=message) as err:
        analyze(AnalyzeRequest(config=str(path)))
    assert "per_layer_config" in str(err.value)


def test_an_mlp_only_override_changes_no_cache(tmp_path):
    """per_layer_config overriding MLP fields only (a transformers 5 heterogeneous MoE config): one shape."""
    path = gemma4_26b_config(tmp_path, per_layer_config={"03": {"intermediate_size": 4096}})
    m = analyze(AnalyzeRequest(config=str(path)))
    assert {(c.dim, c.num_head) for layer in m.layers for c in layer.caches} == {(256, 8)}
    assert all(layer.head_dim is None for layer in m.layers)


def test_a_hand_edited_layer_shape_breaks_the_manifest_invariants(tmp_path):
    m = analyze(AnalyzeRequest(config=str(gemma4_26b_config(tmp_path))))
    data = m.model_dump(mode="json")
    data["layers"][5]["head_dim"] = 256  # the caches still say 512
    with pytest.raises(ValueError, match=r"layers\[5\]\.caches\[0\]\.dim: 512 is not 256"):
        SelectionManifest.model_validate(data)


def test_render_gives_each_layer_its_shape_and_legacy_refuses_them(tmp_path):
    """The paged render carries each differing layer's shape (LAYER_SHAPES, read by init_kv_cache); a Legacy cache
    (one contiguous [batch, seq, N_kv * D] row per token, one shape in its template) refuses them by name instead of
    rendering every layer at the model's head_dim."""
    m = analyze(AnalyzeRequest(config=str(gemma4_26b_config(tmp_path))))
    text = render_manifest(m).files["kvcache_attention.py"]
    assert "LAYER_SHAPES = {5: (512, 2), 11: (512, 2), 17: (512, 2), 23: (512, 2), 29: (512, 2)}" in text
    legacy = analyze(AnalyzeRequest(config=str(gemma4_26b_config(tmp_path)), kv_mode="legacy"))
    with pytest.raises(InputError, match=r"not supported by kvcache yet: per-layer attention shapes \(5 layer") as err:
        render_manifest(legacy)
    assert err.value.field == "layers[5].head_dim" and "on a legacy cache" in str(err.value)
