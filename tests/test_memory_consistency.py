"""The manifest's memory plan and the framework harness's block math agree on the same model.

analyzer.memory plans from the manifest's groups; validators.harness reproduces the framework's
calculate_block_num from a ModelCacheInfo. Both size pools with analyzer.kv_cache_spec; this test
checks the two paths to those specs (manifest groups vs cache entries, MTP merge included) land on
the same blocks (offline and budget-based, with and without sliding groups).
"""

from __future__ import annotations

import pytest
import torch
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.memory import GIB
from model_infer_kvcache.validators.harness import calculate_block_num, get_generation

CONFIGS = "tests/fixtures/configs"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _cache_info(manifest):
    """The main model's cache info, merged with the MTP model's (one full-attention layer each) as the
    framework's execution engine does when speculative decoding is on."""
    g = get_generation("G2")

    def info(plans):
        layers = []
        for i, layer in enumerate(plans):
            entries = [g.CacheEntry(cache_name=c.name, attn_type=layer.attn_type, dim=c.dim, num_head=c.num_head,
                                    dtype=DTYPES[c.dtype], needs_block=True, block_size=manifest.block_size,
                                    sliding_window=layer.sliding_window) for c in layer.caches]
            layers.append(g.LayerCacheInfo(layer_idx=i, caches=entries))
        return g.ModelCacheInfo(num_layers=len(layers), layer_infos=layers, is_mla_backend=manifest.mla.enabled)

    main = info(manifest.layers)
    if not manifest.model.num_mtp_layers:
        return main
    full = next(layer for layer in manifest.layers if layer.attn_type == "FullAttention")
    return main.merge(info([full] * manifest.model.num_mtp_layers))


@pytest.mark.parametrize("config", ["qwen3_8b", "gpt_oss_20b", "mistral_7b_v01", "deepseek_v3"])
def test_offline_blocks_agree(config):
    m = analyze(AnalyzeRequest(config=f"{CONFIGS}/{config}.json", max_len=8192, max_concurrency=16))
    harness = calculate_block_num(_cache_info(m), max_concurrency=16, offline_max_len=8192)
    assert m.memory.blocks == harness


@pytest.mark.parametrize("config", ["qwen3_8b", "gpt_oss_20b", "deepseek_v3", "glm4_moe"])
def test_budget_blocks_agree(config):
    m = analyze(AnalyzeRequest(config=f"{CONFIGS}/{config}.json", hbm_gb=40, kv_mem_ratio=0.9,
                               max_concurrency=16, max_len=8192))
    harness = calculate_block_num(_cache_info(m), max_concurrency=16, available_kv_memory=40 * GIB,
                                  kv_cache_mem_ratio=0.9)
    assert m.memory.blocks == harness
