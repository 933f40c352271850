"""Time `kvcache lint` on a generated ~3,000-line framework-mode modeling file.

    python benchmarks/bench_lint.py                 # ~3,000 lines, best of 5, text summary
    python benchmarks/bench_lint.py --lines 6000 --repeat 3 --json

The file repeats realistic attention / decoder-layer classes (cache entries, prefill/decode
branches, FA v1/v2 calls, writers) with a few planted bugs, so every rule family does real work.
Timings cover parsing plus linting, with and without a manifest (gpt-oss-20b, G2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADER = '''"""Generated benchmark model (framework mode, mixed sliding / full attention)."""
import math

import torch
import torch_npu
from torch import nn

from executor.core.kv_cache import CacheEntry, LayerCacheInfo, ModelCacheInfo
from executor.utils.common_utils import get_init_attn_mask

'''

BLOCK = '''
class Attention{i}(nn.Module):
    def __init__(self, config, infer_config, layer_idx):
        super().__init__()
        tp = infer_config.parallel_config.attn_tp_size
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_attention_heads_per_rank = config.num_attention_heads // tp
        self.num_key_value_heads_per_rank = max(config.num_key_value_heads // tp, 1)
        self.scaling = self.head_dim ** -0.5
        self.block_size = infer_config.kv_cache_config.block_size
        self.sinks = nn.Parameter(torch.empty(self.num_attention_heads_per_rank))
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        self.attn_type = "SlidingWindow" if self.sliding_window else "FullAttention"
        self.attn_mask = get_init_attn_mask(2048, "npu")
        self.k_cache = torch.Tensor([])
        self.v_cache = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(cache_name="k_cache", attn_type=self.attn_type, dim=self.head_dim,
                       num_head=self.num_key_value_heads_per_rank, dtype=config.torch_dtype,
                       needs_block=True, block_size=self.block_size, sliding_window=self.sliding_window,
                       tensor_setter=lambda t, layer=self: setattr(layer, "k_cache", t)),
            CacheEntry(cache_name="v_cache", attn_type=self.attn_type, dim=self.head_dim,
                       num_head=self.num_key_value_heads_per_rank, dtype=config.torch_dtype,
                       needs_block=True, block_size=self.block_size, sliding_window=self.sliding_window,
                       tensor_setter=lambda t, layer=self: setattr(layer, "v_cache", t)),
        ]

    def write_cache(self, key, value, forward_metadata):
        slot_mapping = forward_metadata.slot_mapping[self.attn_type]
        n, d = self.num_key_value_heads_per_rank, self.head_dim
        torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, n, d), slot_mapping.view(-1, 1), key)
        torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, n, d), slot_mapping.view(-1, 1), value)

    def forward(self, hidden_states, forward_metadata, **kwargs):
        query, key, value = self.project(hidden_states)
        self.write_cache(key, value, forward_metadata)
        if self.sliding_window:
            sparse_mode = 4
            pre_tokens = self.sliding_window - 1
        else:
            sparse_mode = 3
            pre_tokens = 2147483647
        if forward_metadata.is_prefill:
            actual_seq_qlen = forward_metadata.actual_seq_lengths_cu_q
        else:
            actual_seq_qlen = forward_metadata.actual_seq_lengths_cu_q
        bn, bs = self.k_cache.shape[0], self.k_cache.shape[1]
        attn_output, _ = torch_npu.npu_fused_infer_attention_score_v2(
            query, self.k_cache.view(bn, bs, -1), self.v_cache.view(bn, bs, -1),
            num_query_heads=self.num_attention_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="TND",
            softmax_scale=self.scaling,
            learnable_sink=self.sinks,
            atten_mask=self.attn_mask,
            sparse_mode=sparse_mode,
            pre_tokens=pre_tokens,
            next_tokens=0,
            block_table=forward_metadata.block_table[self.attn_type],
            block_size=bs,
            actual_seq_qlen=actual_seq_qlen,
            actual_seq_kvlen=forward_metadata.actual_seq_lengths_kv,
        )
        return self.o_proj(attn_output.reshape(-1, self.num_attention_heads_per_rank * self.head_dim))


class DecoderLayer{i}(nn.Module):
    def __init__(self, config, infer_config, layer_idx):
        super().__init__()
        self.self_attn = Attention{i}(config, infer_config, layer_idx)
        self.mlp = MLP(config, infer_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, forward_metadata, residual=None):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, forward_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

'''

# Planted bugs (one per rule family) so the rules exercise their reporting paths too.
BUGS = '''
class BuggyAttention(nn.Module):
    def __init__(self, config, infer_config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        self.attn_type = "FullAttention"
        self.cache_entries = [CacheEntry(cache_name="k_cache", attn_type=self.attn_type, dim=self.head_dim,
                                         num_head=config.num_key_value_heads, dtype=config.torch_dtype,
                                         needs_block=True, block_size=128)]

    def forward(self, hidden_states, forward_metadata, kv_len=None, **kwargs):
        query, key_cache, value_cache = self.project(hidden_states)
        kv_len += 1
        if forward_metadata.is_prefill:
            return torch_npu.npu_fused_infer_attention_score_v2(
                query, key_cache, value_cache, scale=self.scaling, sparse_mode=0,
                block_table=forward_metadata.block_table, input_layout="BSND")
        return None


class BenchForCausalLM(nn.Module):
    def get_cache_info(self):
        layer_infos = [LayerCacheInfo(layer_idx=i, caches=layer.self_attn.cache_entries)
                       for i, layer in enumerate(self.model.layers)]
        return ModelCacheInfo(num_layers=len(layer_infos), layer_infos=layer_infos)
'''


def generate(lines: int) -> str:
    parts = [HEADER]
    i = 0
    while sum(p.count("\n") for p in parts) + BUGS.count("\n") < lines:
        parts.append(BLOCK.format(i=i))
        i += 1
    parts.append(BUGS)
    return "".join(parts)


def _time(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def run(lines: int = 3000, repeat: int = 5) -> dict:
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.validators.lint import lint_source

    source = generate(lines)
    manifest = analyze(AnalyzeRequest(config=str(ROOT / "tests/fixtures/configs/gpt_oss_20b.json"),
                                      framework_api="G2"))
    lint_source(source, "bench_model.py")  # warm caches (schema JSON, imports)
    findings = lint_source(source, "bench_model.py")
    with_manifest = lint_source(source, "bench_model.py", manifest=manifest)
    plain = _time(lambda: lint_source(source, "bench_model.py"), repeat)
    checked = _time(lambda: lint_source(source, "bench_model.py", manifest=manifest), repeat)
    return {
        "lines": source.count("\n"),
        "repeat": repeat,
        "findings": len(findings),
        "findings_with_manifest": len(with_manifest),
        "rules_fired": sorted({f.rule for f in with_manifest}),
        "seconds_best": round(min(plain), 4),
        "seconds_median": round(statistics.median(plain), 4),
        "seconds_best_with_manifest": round(min(checked), 4),
        "seconds_median_with_manifest": round(statistics.median(checked), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=3000, help="approximate size of the generated file")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per variant (best and median reported)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = run(args.lines, args.repeat)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"linted a {result['lines']}-line modeling file: best {result['seconds_best'] * 1000:.0f} ms, "
              f"median {result['seconds_median'] * 1000:.0f} ms ({result['findings']} planted findings); "
              f"with --manifest best {result['seconds_best_with_manifest'] * 1000:.0f} ms, "
              f"median {result['seconds_median_with_manifest'] * 1000:.0f} ms "
              f"(rules fired: {', '.join(result['rules_fired'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
