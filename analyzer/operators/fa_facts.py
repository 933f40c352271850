"""What the fused-attention (FA) arguments mean across operator versions, and the FA constants.

The pinned schemas (:mod:`analyzer.operators.schemas`) say which keywords each operator accepts
and what it falls back to when one is missing. They cannot say that ``scale`` (v1) and
``softmax_scale`` (v2) are the same argument: that cross-version meaning is the table
``FA_KEYWORDS`` below, the only place it is written. The templates context, the linter, the
emulator front ends, the validation call checks and the doc tables derive their views from it;
``tests/test_one_home_ops.py`` fails if a copy comes back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from model_infer_kvcache.analyzer.operators import schemas

# The schemas' "no limit" for pre_tokens / next_tokens (their default), and the non-sliding band.
INT32_MAX = 2147483647
# Page-attention block sizes the FA paged path accepts for Q_S > 1 (references/fa_operators.md, '传给 FA 的 paged KV').
VALID_BLOCK_SIZES = (128, 256, 384, 512)

# sparse_mode values the operators document as supported (5-8 are documented as unsupported), and
# the ones that take the compressed causal template as atten_mask instead of a full mask.
SPARSE_MODES = (0, 1, 2, 3, 4)
COMPRESSED_MASK_MODES = (2, 3, 4)
BAND_MODE = 4  # sparse_mode of a pre_tokens/next_tokens band (sliding window)
COMPRESSED_MASK_SIZE = 2048
COMPRESSED_MASK_SHAPES = tuple((1,) * lead + (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE) for lead in range(3))

MAX_GQA_RATIO = 64  # query heads / KV heads (num_key_value_heads rule of the op docs)
# A score bias the paged path cannot take (a relative-position bias, ALiBi): the pinned op docs list the TND layout
# kvcache's paged render uses without pse, and in another paged layout a pse_shift spans every block-table slot. The
# one wording of that limit, with its lines, for each refusal resting on it.
PAGED_PSE_LIMIT = ("the paged FA call kvcache renders is TND, and the op docs list TND without pse "
                   "(npu_fused_infer_attention_score input_layout 'TND(不支持左padding、tensorlist、pse、...)': torch_npu "
                   "2.14.0 _op_plugin_docs.py:8113, 2.9.0:6684; _v2: 2.14.0:8632, 2.9.0:7201); in another layout a "
                   "paged pse_shift must span block_table.shape[1] x block_size keys (2.14.0:8293, 2.9.0:6864), a dense "
                   "[B, N, Q_S, KV] bias rebuilt every step, which kvcache does not plan")
# The keys a paged FA call attends: each request's first kv_len, cut by sparse_mode's causal / band masks, or an
# atten_mask spanning every block-table slot (sparse_mode 0 / 1). No hashed or per-query key subset.
PAGED_MASK_LIMIT = ("a paged FA call attends each request's cached keys up to its length, cut by sparse_mode's causal "
                    "or band mask (sparse_mode 0-4), or by an atten_mask that must span block_table.shape[1] x "
                    "block_size keys (torch_npu 2.14.0 _op_plugin_docs.py:8292, 2.9.0:6863) rebuilt every step from "
                    "every cached key's bucket, which kvcache does not plan")
# MLA (query_rope/key_rope given, query D 512): the query head counts FA takes. torch_npu 2.14.0's
# npu_fused_infer_attention_score_v2 doc: "query_rope配置时要求query的s为1-16、n为1/2/4/8/16/32/64/128"; the v1 doc of
# both pinned releases still says "N为32、64、128" there (an older statement of the same kernel's rule).
MLA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
MLA_ROPE_DIM = 64  # head dim of query_rope / key_rope
# The latent (query D) an MLA call over a paged cache takes: with query_rope, D is 512 or 128, and D 128 takes no
# page attention (torch_npu 2.14.0 _op_plugin_docs.py:8715, 2.9.0 :7283: "不支持左padding、tensorlist、pse、page
# attention"), so the paged absorb path needs 512.
MLA_PAGED_LATENT_DIM = 512
MLA_PAGED_LATENT_SOURCE = "torch_npu 2.14.0 _op_plugin_docs.py:8715 (2.9.0 :7283)"
# Value heads narrower than key heads (MiMo-V2-Flash: Q_D = K_D = 192, V_D = 128): the (key D, value D) pairs the
# packed layouts document beside equal ones. torch_npu 2.14.0 _op_plugin_docs.py:8730 (v2, "TND场景，要求Q_D、K_D、V_D
# 等于128，或者Q_D、K_D等于192，V_D等于128/192"; 2.9.0 :7298), v1's TND section :8196 (2.9.0 :6767). The same docs'
# general rule "参数key、value中对应tensor的shape需要完全一致" (2.14.0 :8685, 2.9.0 :7253) says otherwise: the
# device question value_head_dim (analyzer/device_questions.py) keeps the two apart.
VALUE_DIM_PAIRS = frozenset({(192, 128)})
VALUE_DIM_LAYOUTS = ("TND", "NTD_TND")
VALUE_DIM_SOURCE = ("torch_npu 2.14.0 _op_plugin_docs.py:8730 (npu_fused_infer_attention_score_v2, TND: Q_D = K_D = "
                    "192 with V_D 128 or 192; 2.9.0 :7298)")


@dataclass(frozen=True)
class FaKeywords:
    """How one FA version spells the arguments whose name differs between v1 and v2.

    Each field but ``op`` is a role; the same role in two versions is the same argument.
    """

    op: str
    scale: str
    num_heads: str
    q_lens: str
    kv_lens: str
    lse_flag: str


FA_KEYWORDS: dict[str, FaKeywords] = {
    "v1": FaKeywords("npu_fused_infer_attention_score", "scale", "num_heads", "actual_seq_lengths",
                     "actual_seq_lengths_kv", "softmax_lse_flag"),
    "v2": FaKeywords("npu_fused_infer_attention_score_v2", "softmax_scale", "num_query_heads", "actual_seq_qlen",
                     "actual_seq_kvlen", "return_softmax_lse"),
}
FA_VERSIONS = tuple(FA_KEYWORDS)


@dataclass(frozen=True)
class SparseFaCall:
    """DeepSeek sparse attention's attention call (``manifest.dsa``): MLA absorb over the lightning indexer's top-k
    keys of each query, in place of any FA call. The rendered call passes these, the validation checks them."""

    op: str
    layout_query: str  # packed tokens, as the framework's 1-D inputs
    layout_kv: str  # the paged latent / rope caches, [num_blocks, block_size, 1, dim]
    sparse_mode: int  # rightDownCausal: a query attends only keys up to its own position, prefill and decode alike


SPARSE_FA = SparseFaCall("npu_sparse_flash_attention", "TND", "PA_BSND", 3)
FA_OPS = {version: kw.op for version, kw in FA_KEYWORDS.items()}
FA_OP_NAMES = frozenset(FA_OPS.values())
ROLES = tuple(f.name for f in fields(FaKeywords) if f.name != "op")


def version_of(op: str) -> str:
    """``"v1"`` / ``"v2"`` for an FA operator name."""
    for version, name in FA_OPS.items():
        if name == op:
            return version
    raise KeyError(f"{op!r} is not a fused-attention operator; known: {sorted(FA_OP_NAMES)}")


def keywords_of(op: str) -> FaKeywords:
    return FA_KEYWORDS[version_of(op)]


def renames() -> tuple[tuple[str, str], ...]:
    """``(v1 keyword, v2 keyword)`` of every role, in role order."""
    return tuple((getattr(FA_KEYWORDS["v1"], role), getattr(FA_KEYWORDS["v2"], role)) for role in ROLES)


def other_version_names(op: str) -> dict[str, tuple[str, str | None]]:
    """Keywords of the *other* FA version, each with ``op``'s own spelling and that argument's default.

    ``{"scale": ("softmax_scale", "1.0"), ...}`` for v2: a v1 name on a v2 call is not read, and
    the operator uses the schema default of the right name instead.
    """
    own = keywords_of(op)
    other = next(kw for kw in FA_KEYWORDS.values() if kw.op != op)
    return {getattr(other, role): (getattr(own, role), schemas.default_text(op, getattr(own, role)))
            for role in ROLES}


def value_passed(op: str, kwargs: Mapping[str, Any], name: str) -> Any:
    """What ``op`` uses for argument ``name`` in a call made with ``kwargs`` (the schema default if absent)."""
    return kwargs[name] if name in kwargs else schemas.default_value(op, name)


# The FA arguments a validation run records and compares with the manifest, in either version's spelling.
RECORDED_KEYWORDS = frozenset({"sparse_mode", "pre_tokens", "next_tokens", "num_key_value_heads", "input_layout",
                               "block_size"} | {name for kw in FA_KEYWORDS.values() for name in (kw.scale, kw.num_heads)})
