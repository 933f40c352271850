"""Cache kinds are types: the specs in analyzer/kv_cache_spec.py are the one home of each kind's facts.

No code, the framework harness included (it mirrors upstream's managers, not their spelling), spells an attn_type:
it names a kind through the constants or asks its spec (``AttentionLayerPlan.is_sliding``, ``is_windowed``,
``holds_state``, ``spec_for_layer_kind``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer import kv_cache_spec as kinds
from model_infer_kvcache.analyzer.manifest import AttentionLayerPlan, MaskPerPath, PerPath
from model_infer_kvcache.analyzer.rules import decide_attn_type, decide_sparse

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("analyzer", "implementer", "validators", "model_infer_kvcache")
ATTN_TYPES = {kinds.FULL_ATTENTION, kinds.SLIDING_WINDOW, kinds.MAMBA}


def files_spelling_attn_types(root: Path = ROOT) -> set[str]:
    out = set()
    for folder in PRODUCT:
        for path in (root / folder).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if any(isinstance(n, ast.Constant) and n.value in ATTN_TYPES for n in ast.walk(tree)):
                out.add(rel)
    return out


def test_attn_type_strings_live_in_the_kinds_home_only():
    assert files_spelling_attn_types() == {"analyzer/kv_cache_spec.py"}


def test_a_string_comparison_added_elsewhere_is_found(tmp_path):
    for folder in PRODUCT:
        (tmp_path / folder).mkdir()
    (tmp_path / "validators" / "new_check.py").write_text(
        "def sliding(layer):\n    return layer.attn_type == 'SlidingWindow'\n", encoding="utf-8")
    assert files_spelling_attn_types(tmp_path) == {"validators/new_check.py"}


@pytest.mark.parametrize("layer_kind, attn_type, windowed", [("full", kinds.FULL_ATTENTION, False),
                                                             ("sliding", kinds.SLIDING_WINDOW, True)])
def test_the_spec_decides_the_kind(layer_kind, attn_type, windowed):
    spec = kinds.spec_for_layer_kind(layer_kind)
    assert decide_attn_type(layer_kind) == spec.attn_type == attn_type
    assert spec.windowed is windowed and kinds.is_windowed(attn_type) is windowed
    layer = AttentionLayerPlan(index=0, decoder_layer=0, attn_type=attn_type, sliding_window=128 if windowed else None,
                               group_key=attn_type, sparse_mode=PerPath(prefill=3, decode=3), pre_tokens=0,
                               next_tokens=0, mask=MaskPerPath(prefill="causal_2048", decode="causal_2048"),
                               write_op="npu_scatter_nd_update_", caches=[])
    assert layer.is_sliding is windowed
    sparse, _, _ = decide_sparse(attn_type, is_mla=False, kv_mode="paged")
    assert (sparse.decode == 4) is windowed  # a windowed kind takes the band on both paths


def test_every_planned_kind_has_its_memory_spec():
    for attn_type in kinds.PLANNED_ATTN_TYPES:
        assert kinds.SPEC_BY_ATTN_TYPE[attn_type].attn_type == attn_type
    assert kinds.SPEC_BY_ATTN_TYPE[kinds.MAMBA].fixed and kinds.MAMBA in kinds.FIXED_BLOCK_ATTN_TYPES
