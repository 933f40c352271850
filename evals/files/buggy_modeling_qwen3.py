# ruff: noqa
# Eval input: a hand-ported Qwen3 attention for framework mode (cann-recipes-infer, API G2).
# It runs without errors on the NPU and produces wrong text. Do not fix it here: it is the input
# of an evaluation case in evals/evals.json.
import torch
import torch_npu
from torch import nn

from executor.core.kv_cache.cache_info import CacheEntry


class Qwen3Attention(nn.Module):
    def __init__(self, config, infer_config, layer_idx):
        super().__init__()
        self.attn_tp_size = infer_config.parallel_config.attn_tp_size
        self.head_dim = config.head_dim
        self.num_heads_per_rank = config.num_attention_heads // self.attn_tp_size
        self.num_kv_heads_per_rank = max(config.num_key_value_heads // self.attn_tp_size, 1)
        self.scaling = self.head_dim ** -0.5
        self.block_size = infer_config.scheduler_config.block_size
        self.attn_type = "FullAttention"
        self.k_cache = torch.Tensor([])
        self.v_cache = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(cache_name=name, attn_type=self.attn_type, dim=self.head_dim,
                       num_head=config.num_key_value_heads, dtype=config.torch_dtype,
                       needs_block=True, block_size=self.block_size,
                       tensor_setter=lambda t, layer=self, n=name: setattr(layer, n, t))
            for name in ("k_cache", "v_cache")
        ]

    def forward(self, hidden_states, kv_len, forward_metadata, **kwargs):
        query, key, value = self.project(hidden_states)
        slot_mapping = forward_metadata.slot_mapping[self.attn_type]
        torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, self.num_kv_heads_per_rank, self.head_dim),
                                         slot_mapping.view(-1, 1), key)
        torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, self.num_kv_heads_per_rank, self.head_dim),
                                         slot_mapping.view(-1, 1), value)
        kv_len += 1
        if forward_metadata.is_prefill:
            sparse_mode = 0
            attn_mask = None
        else:
            sparse_mode = 3
            attn_mask = forward_metadata.attention_mask
        bn, bs = self.k_cache.shape[0], self.k_cache.shape[1]
        attn_output, _ = torch_npu.npu_fused_infer_attention_score_v2(
            query, self.k_cache.view(bn, bs, -1), self.v_cache.view(bn, bs, -1),
            num_query_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_kv_heads_per_rank,
            input_layout="TND",
            scale=self.scaling,
            atten_mask=attn_mask,
            sparse_mode=sparse_mode,
            block_table=forward_metadata.block_table,
            block_size=bs,
            actual_seq_qlen=forward_metadata.actual_seq_lengths_cu_q,
            actual_seq_kvlen=forward_metadata.actual_seq_lengths_kv,
        )
        return self.o_proj(attn_output.view(-1, self.num_heads_per_rank * self.head_dim))
