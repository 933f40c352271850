"""CPU emulations of the torch_npu operators, named and shaped exactly like the real ones.

Signatures (argument names, order, the keyword-only ``*``, defaults) equal the pinned
schemas in ``analyzer/operators/op_schemas.json`` (an operator newer than the pin, npu_chunk_gated_delta_rule:
``op_schemas-2.14.0.json``); ``tests/test_npu_ops_schema_pin.py`` enforces it. Passing an
argument the real operator does not have raises ``TypeError`` here, exactly as a misspelt
keyword does on the device build.

Precision: arithmetic in float32 (float64 for float64 inputs); results in the input dtype.
float64 is a CPU validation mode, not a device dtype (the real operators take fp16/bf16/fp32):
``kvcache validate`` runs in it by default so that honest code differs from transformers by
rounding only, and keeps float32/bf16 (``--dtype``) for device precision.
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.operators.fa_facts import INT32_MAX
from model_infer_kvcache.validators.npu_ops import (
    activations,
    formats,
    gated_delta,
    matmul,
    mla_prolog,
    moe,
    moe_comm,
    norms,
    rotary,
    sparse_attention,
    writers,
)
from model_infer_kvcache.validators.npu_ops.errors import UnemulatedFeatureError
from model_infer_kvcache.validators.npu_ops.fused_attention import V1_NAMES, V2_NAMES, fused_infer_attention


def _refuse_unemulated(op: str, **tensors) -> None:
    for name, value in tensors.items():
        if value is not None:
            raise UnemulatedFeatureError(op, name, "this feature (quantization / pse / padding / shared prefix) "
                                             "is not emulated; validate it on an NPU")


def npu_fused_infer_attention_score(
    query, key, value, *,
    pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
    dequant_scale1=None, quant_scale1=None, dequant_scale2=None, quant_scale2=None, quant_offset2=None,
    antiquant_scale=None, antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
    value_antiquant_scale=None, value_antiquant_offset=None, block_table=None, query_padding_size=None,
    kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None,
    query_rope=None, key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
    pre_tokens=INT32_MAX, next_tokens=INT32_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
    inner_precise=0, block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
    softmax_lse_flag=False,
):
    """FA v1: ``(attention_out, softmax_lse)``; see ``fused_attention`` for the enforced rules."""
    _refuse_unemulated(
        V1_NAMES.op, pse_shift=pse_shift, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
        antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
        value_antiquant_scale=value_antiquant_scale, value_antiquant_offset=value_antiquant_offset,
        query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
        key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
        actual_shared_prefix_len=actual_shared_prefix_len, key_rope_antiquant_scale=key_rope_antiquant_scale,
    )
    return fused_infer_attention(
        V1_NAMES, query, key, value, atten_mask=atten_mask, actual_q=actual_seq_lengths,
        actual_kv=actual_seq_lengths_kv, block_table=block_table, query_rope=query_rope, key_rope=key_rope,
        learnable_sink=None, num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale=scale,
        pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout, sparse_mode=sparse_mode,
        inner_precise=inner_precise, block_size=block_size, return_lse=softmax_lse_flag,
    )


def npu_fused_infer_attention_score_v2(
    query, key, value, *,
    query_rope=None, key_rope=None, pse_shift=None, atten_mask=None, actual_seq_qlen=None,
    actual_seq_kvlen=None, block_table=None, dequant_scale_query=None, dequant_scale_key=None,
    dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None, dequant_scale_key_rope=None,
    quant_scale_out=None, quant_offset_out=None, learnable_sink=None, num_query_heads=1, num_key_value_heads=0,
    softmax_scale=1.0, pre_tokens=INT32_MAX, next_tokens=INT32_MAX, input_layout="BSH", sparse_mode=0,
    block_size=0, query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0,
    return_softmax_lse=False, query_dtype=None, key_dtype=None, value_dtype=None, query_rope_dtype=None,
    key_rope_dtype=None, key_shared_prefix_dtype=None, value_shared_prefix_dtype=None,
    dequant_scale_query_dtype=None, dequant_scale_key_dtype=None, dequant_scale_value_dtype=None,
    dequant_scale_key_rope_dtype=None,
):
    """FA v2: ``(attention_out, softmax_lse)``; adds ``learnable_sink``. The ``*_dtype`` args are
    documented as reserved and are ignored."""
    _refuse_unemulated(
        V2_NAMES.op, pse_shift=pse_shift, dequant_scale_query=dequant_scale_query,
        dequant_scale_key=dequant_scale_key, dequant_offset_key=dequant_offset_key,
        dequant_scale_value=dequant_scale_value, dequant_offset_value=dequant_offset_value,
        dequant_scale_key_rope=dequant_scale_key_rope, quant_scale_out=quant_scale_out,
        quant_offset_out=quant_offset_out,
    )
    return fused_infer_attention(
        V2_NAMES, query, key, value, atten_mask=atten_mask, actual_q=actual_seq_qlen,
        actual_kv=actual_seq_kvlen, block_table=block_table, query_rope=query_rope, key_rope=key_rope,
        learnable_sink=learnable_sink, num_heads=num_query_heads, num_key_value_heads=num_key_value_heads,
        scale=softmax_scale, pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
        sparse_mode=sparse_mode, inner_precise=inner_precise, block_size=block_size,
        return_lse=return_softmax_lse,
    )


def npu_scatter_nd_update_(self, indices, updates):
    """In place: ``self[indices] = updates`` (ScatterNd); returns ``self``."""
    return writers.scatter_nd_update_("npu_scatter_nd_update_", self, indices, updates)


def npu_scatter_nd_update(self, indices, updates):
    """Out of place variant: ``self`` is left unchanged."""
    return writers.scatter_nd_update_("npu_scatter_nd_update", self.clone(), indices, updates)


def scatter_update_(self, indices, updates, axis):
    """In place: per batch ``i``, write ``updates[i]`` at offset ``indices[i]`` along ``axis``."""
    return writers.scatter_update_("scatter_update_", self, indices, updates, axis)


def scatter_update(self, indices, updates, axis):
    """Out of place variant: ``self`` is left unchanged."""
    return writers.scatter_update_("scatter_update", self.clone(), indices, updates, axis)


def npu_kv_rmsnorm_rope_cache(
    kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
    k_rope_scale=None, c_kv_scale=None, k_rope_offset=None, c_kv_offset=None, v=None,
    epsilon=1e-5, cache_mode="Norm", is_output_kv=False,
):
    """Returns ``(k_cache, ckv_cache, k_rope, c_kv)``; the caches are updated in place (same objects)."""
    k_rope, c_kv = writers.kv_rmsnorm_rope_cache(
        "npu_kv_rmsnorm_rope_cache", kv, gamma, cos, sin, index, k_cache, ckv_cache,
        quant_args={"k_rope_scale": k_rope_scale, "c_kv_scale": c_kv_scale,
                    "k_rope_offset": k_rope_offset, "c_kv_offset": c_kv_offset},
        v=v, epsilon=epsilon, cache_mode=cache_mode, is_output_kv=is_output_kv,
    )
    return k_cache, ckv_cache, k_rope, c_kv


def npu_kv_rmsnorm_rope_cache_v2(
    kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
    k_rope_scale=None, c_kv_scale=None, k_rope_offset=None, c_kv_offset=None, v=None,
    epsilon=1e-5, cache_mode="Norm", is_output_kv=False,
):
    """In-place variant used by the DeepSeek recipes: updates the caches, returns ``(k_rope, c_kv)``."""
    return writers.kv_rmsnorm_rope_cache(
        "npu_kv_rmsnorm_rope_cache_v2", kv, gamma, cos, sin, index, k_cache, ckv_cache,
        quant_args={"k_rope_scale": k_rope_scale, "c_kv_scale": c_kv_scale,
                    "k_rope_offset": k_rope_offset, "c_kv_offset": c_kv_offset},
        v=v, epsilon=epsilon, cache_mode=cache_mode, is_output_kv=is_output_kv,
    )


OPS = {
    "npu_fused_infer_attention_score": npu_fused_infer_attention_score,
    "npu_fused_infer_attention_score_v2": npu_fused_infer_attention_score_v2,
    "npu_scatter_nd_update": npu_scatter_nd_update,
    "npu_scatter_nd_update_": npu_scatter_nd_update_,
    "scatter_update": scatter_update,
    "scatter_update_": scatter_update_,
    "npu_kv_rmsnorm_rope_cache": npu_kv_rmsnorm_rope_cache,
    "npu_kv_rmsnorm_rope_cache_v2": npu_kv_rmsnorm_rope_cache_v2,
}
# Model-side operators (norms, rotary, activations, formats, MoE, matmuls, gated delta rule): one module per family.
for _family in (norms, rotary, activations, formats, moe, moe_comm, matmul, mla_prolog, sparse_attention, gated_delta):
    OPS.update(_family.OPS)

__all__ = list(OPS) + ["OPS"]
