"""Field lists per API generation, generation detection, ForwardMetaData and the causal mask."""

import dataclasses
import textwrap

import pytest
import torch
from model_infer_kvcache.validators.harness import (
    ForwardMetaData,
    detect_generation_from_classes,
    detect_generation_from_source,
    get_generation,
    get_init_attn_mask,
)
from model_infer_kvcache.validators.harness.forward_metadata import (
    get_forward_metadata,
    reset_forward_metadata,
    set_forward_metadata,
)
from model_infer_kvcache.validators.harness.generations import field_names


def _defaults(cls):
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default if f.default is not dataclasses.MISSING else "<required>"
    return out


ENTRY_G0 = ["cache_name", "attn_type", "dim", "num_head", "dtype", "needs_block", "tensor_setter", "sliding_window"]


def test_g0_fields_and_defaults():
    g = get_generation("G0")
    assert field_names(g.CacheEntry) == ENTRY_G0
    assert _defaults(g.CacheEntry)["tensor_setter"] is None
    assert _defaults(g.CacheEntry)["sliding_window"] is None
    assert field_names(g.ModelCacheInfo) == ["num_layers", "block_size", "layer_infos"]
    assert field_names(g.LayerCacheInfo) == ["layer_idx", "caches"]
    assert g.table_key == "attn_type" and g.model_level_block_size and not g.has_is_mla_backend


def test_g1_adds_tensor_and_is_mla_backend():
    g = get_generation("G1")
    assert field_names(g.CacheEntry) == ENTRY_G0 + ["tensor"]
    assert field_names(g.ModelCacheInfo) == ["num_layers", "block_size", "layer_infos", "is_mla_backend"]
    assert _defaults(g.ModelCacheInfo)["is_mla_backend"] is False
    assert g.table_key == "attn_type"


def test_g2_has_the_eleven_fields_of_48a59dc():
    g = get_generation("g2")
    assert field_names(g.CacheEntry) == [
        "cache_name", "attn_type", "dim", "num_head", "dtype", "needs_block",
        "block_size", "manager_key", "tensor_setter", "sliding_window", "tensor",
    ]
    assert g.sliding_prefill_extra_tokens == 0 and g.MambaCacheEntry is None and g.render_api == "G2"


def test_g3_per_entry_block_size_and_group_key():
    g = get_generation("g3")
    assert g.render_api == "G2" and g.sliding_prefill_extra_tokens == 1 and g.decode_admission == "skip"
    assert field_names(g.CacheEntry) == [
        "cache_name", "attn_type", "dim", "num_head", "dtype", "needs_block",
        "block_size", "manager_key", "tensor_setter", "sliding_window",
        "allocator", "compress_ratio", "tensor", "cache_layout",
    ]
    defaults = _defaults(g.CacheEntry)
    assert defaults["block_size"] is None and defaults["manager_key"] is None
    assert defaults["compress_ratio"] == 1 and defaults["cache_layout"] == "BnBsND"
    assert field_names(g.ModelCacheInfo) == ["num_layers", "layer_infos", "is_mla_backend"]
    plain = g.CacheEntry("k_cache", "FullAttention", 64, 2, torch.bfloat16, True, block_size=128)
    keyed = g.CacheEntry("nope_cache", "FullAttention", 512, 1, torch.bfloat16, True, block_size=128,
                         manager_key="latent")
    assert plain.group_key == "FullAttention"
    assert keyed.group_key == "latent"
    assert keyed.cache_dim_numel() == 512
    assert g.CacheEntry("c", "FullAttention", [4, 8], 1, torch.float16, True, block_size=64,
                        compress_ratio=4).storage_block_size == 16
    assert g.table_key == "group_key" and not g.model_level_block_size


def test_unknown_generation_rejected():
    with pytest.raises(ValueError, match="G3"):
        get_generation("G4")


def test_mamba_entry_rules():
    g = get_generation("G3")
    entry = g.MambaCacheEntry(cache_name="ssm", dtype=torch.float32, needs_block=True, shape=[4, 8])
    assert entry.attn_type == "Mamba" and entry.block_size == 1 and entry.cache_dim_numel() == 32
    for bad in ({"shape": []}, {"shape": [4, 0]}, {"shape": [2], "block_size": 2}, {"shape": [2], "next_n": -1}):
        with pytest.raises(ValueError, match="ssm"):
            g.MambaCacheEntry(cache_name="ssm", dtype=torch.float32, needs_block=True, **bad)
    report = g.OffloadWorkspaceMemoryInfo([g.MemoryBudgetItem("w", 10), g.MemoryBudgetItem("h", 5, "host")])
    assert report.npu_bytes == 10


@pytest.mark.parametrize("gen", ["G0", "G1", "G2", "G3"])
def test_detect_generation_from_classes(gen):
    g = get_generation(gen)
    assert detect_generation_from_classes(g.CacheEntry, g.ModelCacheInfo) == gen


def test_detect_generation_from_source_text():
    # Shapes of the three cache_info.py generations, written for this test.
    g0 = """
        from dataclasses import dataclass
        @dataclass
        class CacheEntry:
            cache_name: str
            attn_type: str
            needs_block: bool
        @dataclass
        class ModelCacheInfo:
            num_layers: int
            block_size: int
            layer_infos: list
    """
    g1 = g0.replace("layer_infos: list", "layer_infos: list\n            is_mla_backend: bool = False")
    g2 = g1.replace("needs_block: bool", "needs_block: bool\n            block_size: int = None").replace(
        "            block_size: int\n            layer_infos", "            layer_infos"
    )
    assert detect_generation_from_source(textwrap.dedent(g0)) == "G0"
    assert detect_generation_from_source(textwrap.dedent(g1)) == "G1"
    assert detect_generation_from_source(textwrap.dedent(g2)) == "G2"
    g3 = g2.replace("block_size: int = None", "block_size: int = None\n            cache_layout: str = 'BnBsND'")
    assert detect_generation_from_source(textwrap.dedent(g3)) == "G3"
    with pytest.raises(ValueError):
        detect_generation_from_source("x = 1\n")
    # The disagreements the analyzer and the installer once had now fail the same way.
    no_block_size = g0.replace("            block_size: int\n", "")
    mla_only = g1.replace("            block_size: int\n", "")
    for text, words in ((no_block_size, "no block_size anywhere"), (mla_only, "is_mla_backend without")):
        with pytest.raises(ValueError, match=words):
            detect_generation_from_source(textwrap.dedent(text))


def test_merge_renumbers_layers_and_checks_block_size():
    g = get_generation("G1")
    a = g.ModelCacheInfo(2, 128, [g.LayerCacheInfo(0, []), g.LayerCacheInfo(1, [])])
    b = g.ModelCacheInfo(1, 128, [g.LayerCacheInfo(0, [])])
    merged = a.merge(b)
    assert merged.num_layers == 3 and [li.layer_idx for li in merged.layer_infos] == [0, 1, 2]
    with pytest.raises(ValueError, match="block_size"):
        a.merge(g.ModelCacheInfo(1, 64, []))


def test_forward_metadata_fields_order_and_defaults():
    assert field_names(ForwardMetaData) == [
        "is_prefill", "attention_mask", "kv_len", "actual_seq_lengths_kv", "actual_seq_lengths_q",
        "actual_seq_lengths_cu_kv", "actual_seq_lengths_cu_q", "actual_seq_lengths_cu_list_kv",
        "actual_seq_lengths_cu_list_q", "actual_seq_lengths_list_kv", "actual_seq_lengths_list_q",
        "prompt_tokens", "block_table", "slot_mapping", "cp_metadata",
    ]
    fm = ForwardMetaData()
    assert fm.is_prefill is False and fm.prompt_tokens == 0 and fm.block_table is None


def test_forward_metadata_global_setter_keeps_other_fields():
    reset_forward_metadata()
    set_forward_metadata(is_prefill=True, prompt_tokens=7)
    set_forward_metadata(kv_len=torch.tensor([3]))
    fm = get_forward_metadata()
    assert fm.is_prefill and fm.prompt_tokens == 7 and fm.kv_len.tolist() == [3]
    reset_forward_metadata()
    assert get_forward_metadata().prompt_tokens == 0


def test_init_attn_mask_is_strict_upper_triangle():
    mask = get_init_attn_mask(2048, "cpu")
    assert mask.shape == (2048, 2048) and mask.dtype == torch.bool
    assert not mask[5, 5] and not mask[5, 0] and mask[0, 5]
    assert int(mask.sum()) == 2048 * 2047 // 2
    assert torch.equal(get_init_attn_mask(4, None, valid_len=1)[-1], torch.zeros(4, dtype=torch.bool))
