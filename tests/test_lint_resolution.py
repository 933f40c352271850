"""How the linter decides what is certain: operator aliases, prefill/decode and sliding branches,
values followed through assignments, and the conservative cases where it must stay silent."""

from __future__ import annotations

import textwrap
from functools import cache
from pathlib import Path

import pytest
from model_infer_kvcache.validators.lint import lint_source

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def rules(source: str, manifest=None, path: str = "modeling_x.py") -> list[tuple[str, int]]:
    return [(f.rule, f.line) for f in lint_source(textwrap.dedent(source), path, manifest=manifest)]


def line_of(source: str, text: str, nth: int = 1) -> int:
    """1-based line of the nth line containing ``text``."""
    hits = [i for i, line in enumerate(textwrap.dedent(source).splitlines(), start=1) if text in line]
    return hits[nth - 1]


@cache
def manifest(config: str, gen: str = "G2", deploy: str | None = None):
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    return analyze(AnalyzeRequest(config=str(CONFIGS / f"{config}.json"), framework_api=gen, deploy_mode=deploy))


# ---------------------------------------------------------------- operator aliases

@pytest.mark.parametrize("prelude, callee", [
    ("import torch_npu as tnpu", "tnpu.npu_fused_infer_attention_score_v2"),
    ("import torch", "torch.ops.npu.npu_fused_infer_attention_score_v2"),
    ("import torch", "torch.ops.npu.npu_fused_infer_attention_score_v2.default"),
    ("from torch_npu import npu_fused_infer_attention_score_v2 as fa2", "fa2"),
    ("from torch_npu import npu_fused_infer_attention_score_v2", "npu_fused_infer_attention_score_v2"),
    ("import torch_npu\nfused = torch_npu.npu_fused_infer_attention_score_v2", "fused"),
    ("", "self.fa_ops.npu_fused_infer_attention_score_v2"),
    ("", "self.attention_op"),
])
def test_operator_recognised_however_reached(prelude, callee):
    source = f"""\
{prelude}
import torch_npu


class Attn:
    def __init__(self):
        self.attention_op = torch_npu.npu_fused_infer_attention_score_v2

    def forward(self, q, k, v):
        return {callee}(q, k, v, scale=0.1)
"""
    assert rules(source) == [("KV101", line_of(source, "scale=0.1"))]


def test_unrelated_call_with_same_keyword_is_ignored():
    assert rules("""\
        def forward(self, x):
            return self.some_other_attention(x, scale=0.1, sparse_mode=0)
    """) == []


# ---------------------------------------------------------------- prefill / decode branches

FA = "torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=8, scale=0.1, sparse_mode={mode})"


def test_else_of_not_is_prefill_is_prefill():
    assert rules(f"""\
        import torch_npu

        def forward(self, q, k, v, forward_metadata):
            if not forward_metadata.is_prefill:
                return {FA.format(mode=3)}
            else:
                return {FA.format(mode=0)}
    """) == [("KV201", 7)]


def test_function_name_gives_the_phase():
    src = f"""\
        import torch_npu

        class Attn:
            def forward_prefill(self, q, k, v):
                return {FA.format(mode=0)}

            def forward_decode(self, q, k, v):
                return {FA.format(mode=0)}
    """
    assert rules(src) == [("KV201", 5)]


def test_conditional_expression_reported_where_the_value_is_written():
    assert rules(f"""\
        import torch_npu

        def forward(self, q, k, v, forward_metadata):
            sparse_mode = 0 if forward_metadata.is_prefill else 3
            return {FA.format(mode="sparse_mode")}
    """) == [("KV201", 4)]


def test_reaching_assignments_split_by_branch():
    override_in_prefill = f"""\
        import torch_npu

        def forward(self, q, k, v, forward_metadata):
            sparse_mode = 0
            if forward_metadata.is_prefill:
                sparse_mode = 3
            return {FA.format(mode="sparse_mode")}
    """
    assert rules(override_in_prefill) == []
    zero_in_prefill = override_in_prefill.replace("sparse_mode = 3", "sparse_mode = 0").replace(
        "sparse_mode = 0\n", "sparse_mode = 3\n", 1)
    assert rules(zero_in_prefill) == [("KV201", 6)]


def test_unknown_phase_is_not_reported():
    # a helper used by both paths: whether it runs at prefill is not known statically
    assert rules(f"""\
        import torch_npu

        class Attn:
            def _attend(self, q, k, v):
                return {FA.format(mode=0)}
    """) == []


def test_unknown_condition_is_not_certain():
    assert rules(f"""\
        import torch_npu

        def forward(self, q, k, v, forward_metadata):
            if forward_metadata.is_prefill:
                sparse_mode = 0 if self.use_legacy_kernel else 3
                return {FA.format(mode="sparse_mode")}
    """) == []


def test_kwargs_passthrough_is_not_missing():
    assert rules("""\
        import torch_npu

        def forward(self, q, k, v, forward_metadata, **fa_kwargs):
            if forward_metadata.is_prefill:
                return torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=8, **fa_kwargs)
    """) == []


def test_omitted_sparse_mode_defaults_to_0():
    assert rules("""\
        import torch_npu

        def forward(self, q, k, v, forward_metadata):
            if forward_metadata.is_prefill:
                return torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=8, scale=0.1)
    """) == [("KV201", 5)]


# ---------------------------------------------------------------- sliding layers and MLA

def test_sliding_class_by_name():
    src = f"""\
        import torch_npu

        class MistralSlidingWindowAttention:
            def forward(self, q, k, v, forward_metadata):
                if forward_metadata.is_prefill:
                    return {FA.format(mode=4)}
                return {FA.format(mode=0)}
    """
    assert rules(src) == [("KV202", 7)]
    assert rules(src.replace("MistralSlidingWindowAttention", "MistralAttention")) == []


def test_sliding_branch_by_attn_type_comparison():
    assert rules(f"""\
        import torch_npu

        class Attn:
            def forward(self, q, k, v):
                if self.attn_type == "SlidingWindow":
                    return {FA.format(mode=0)}
                return {FA.format(mode=0)}
    """) == [("KV202", 6)]


def test_mla_decode_mode_3_in_mtp_branch_is_allowed():
    src = """\
        import torch_npu

        class Attn:
            def forward_absorb(self, q, k, v, q_pe, k_pe, forward_metadata):
                if forward_metadata.is_prefill:
                    mode = 3
                elif self.next_n > 0:
                    mode = 3
                else:
                    mode = 0
                return torch_npu.npu_fused_infer_attention_score_v2(
                    q, k, v, query_rope=q_pe, key_rope=k_pe, num_key_value_heads=1, sparse_mode=mode)
    """
    assert rules(src) == []
    no_mtp = src.replace("elif self.next_n > 0:", "elif True:")
    assert rules(no_mtp) == []  # `elif True` is not understood: the decode 3 is not certain
    plain = src.replace("""                elif self.next_n > 0:
                    mode = 3
                else:
                    mode = 0""", """                else:
                    mode = 3""")
    assert rules(plain) == [("KV203", line_of(plain, "mode = 3", 2))]


# ---------------------------------------------------------------- masks

@pytest.mark.parametrize("mask, expected", [
    ("torch.ones(2048, 2048, dtype=torch.bool).triu(1)", []),
    ("~torch.tril(torch.ones(2048, 2048, dtype=torch.bool))", []),
    ("torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)", []),
    ("torch.triu(torch.ones(2048, 2048), diagonal=1)", ["KV204"]),
    ("torch.full((2048, 2048), float('-inf')).triu(1)", ["KV204"]),
    ("torch.ones(2048, 2048, dtype=torch.bool).triu(1).half()", ["KV204"]),
    ("torch.ones((1, 1, 2048, 2048), dtype=torch.bool)", []),
    ("torch.ones(2048, 2048, dtype=torch.bool).unsqueeze(0)", []),
    ("torch.ones(4096, 4096, dtype=torch.bool)", ["KV205"]),
    ("torch.ones(1, 2048, 4096, dtype=torch.bool)", ["KV205"]),
    ("torch.ones(2048, 2048, dtype=torch.bool).view(1, 2048, -1)", []),
    ("torch.ones(self.max_len, self.max_len, dtype=torch.bool)", []),
])
def test_mask_dtype_and_shape(mask, expected):
    src = f"""\
        import torch
        import torch_npu

        class Attn:
            def __init__(self):
                self.attn_mask = {mask}

            def forward(self, q, k, v):
                return torch_npu.npu_fused_infer_attention_score(
                    q, k, v, num_heads=8, scale=0.1, atten_mask=self.attn_mask, sparse_mode=3)
    """
    assert [rule for rule, _ in rules(src)] == expected


# ---------------------------------------------------------------- deployment mode

STANDALONE_FA = """\
    import torch_npu

    class Attn:
        def forward(self, q, k, v, forward_metadata):
            return torch_npu.npu_fused_infer_attention_score(
                q, k, v, num_heads=32, num_key_value_heads=8, input_layout="TND", scale=self.head_dim ** -0.5,
                atten_mask=forward_metadata.attention_mask, sparse_mode=3,
                block_table=forward_metadata.block_table, block_size=128)
"""


def test_whole_block_table_is_fine_in_standalone_mode():
    # the standalone runner's ForwardMetaData holds one tensor, not a dict
    assert rules(STANDALONE_FA) == []
    assert rules(STANDALONE_FA, manifest("qwen3_8b", deploy="standalone")) == []


def test_whole_block_table_flagged_when_manifest_says_framework():
    assert rules(STANDALONE_FA, manifest("qwen3_8b")) == [("KV301", 8)]


def test_block_table_followed_into_helper_parameter():
    assert rules("""\
        import torch_npu
        from executor.core.kv_cache import CacheEntry

        class Attn:
            def attend(self, q, k, v, table):
                return torch_npu.npu_fused_infer_attention_score(q, k, v, sparse_mode=3, block_table=table)

            def forward(self, q, k, v, forward_metadata):
                tables = forward_metadata.block_table
                return self.attend(q, k, v, tables)
    """) == [("KV301", 10)]


# ---------------------------------------------------------------- kv_len ownership

KV_LEN_BUMP = """\
    class Model:
        def forward(self, input_ids, kv_len):
            kv_len += 1
            kv_len_offset = kv_len + 1
            return kv_len_offset

        def prepare_inputs(self, kv_len):
            kv_len += 1
            return kv_len
"""


def test_kv_len_only_in_model_forward_or_cache_code():
    assert rules(KV_LEN_BUMP) == [("KV401", 3)]


def test_kv_len_in_runner_file_or_class_is_fine():
    assert rules(KV_LEN_BUMP, path="runner_qwen3.py") == []
    assert rules(KV_LEN_BUMP.replace("class Model:", "class Qwen3Runner:")) == []


def test_kv_len_owner_that_is_not_a_model_component():
    # a test driver standing in for the framework: it owns kv_len like a runner does
    assert rules("""\
        class FrameworkStandIn:
            def _build_forward_metadata(self, prompt_len):
                self.kv_len.zero_()
                return self.kv_len

            def _advance_kv_len(self, fm):
                self.kv_len.copy_(fm.actual_seq_lengths_kv)
    """) == []
    assert rules("""\
        class DeepseekMLA(nn.Module):
            def forward_absorb(self, q, forward_metadata):
                forward_metadata.kv_len.copy_(forward_metadata.kv_len + 1)
    """) == [("KV401", 3)]


# ---------------------------------------------------------------- manifest: window arithmetic

def test_pre_tokens_window_expression_uses_manifest_window():
    src = """\
        import torch_npu

        class GptOssSlidingAttention:
            def __init__(self, config):
                self.sliding_window = config.sliding_window
                self.pre_tokens = self.sliding_window {op}

            def forward(self, q, k, v, forward_metadata):
                return torch_npu.npu_fused_infer_attention_score_v2(
                    q, k, v, num_query_heads=64, num_key_value_heads=8, input_layout="TND", softmax_scale=0.125,
                    atten_mask=forward_metadata.attention_mask, sparse_mode=4, pre_tokens=self.pre_tokens,
                    next_tokens=0, block_table=forward_metadata.block_table[self.attn_type], block_size=128)
    """
    m = manifest("gpt_oss_20b")
    assert rules(src.format(op="- 1"), m) == []
    assert rules(src.format(op="+ 0"), m) == [("KV806", 6)]


def _kv806(source: str, manifest) -> list[str]:
    return [f.message for f in lint_source(textwrap.dedent(source), "modeling_x.py", manifest=manifest)
            if f.rule == "KV806"]


def test_pre_tokens_of_the_other_unmeasured_reading_names_the_device_question():
    """Upstream gpt_oss passes pre_tokens = W, right under window_pre_tokens 'inclusive'. While no NPU has settled
    the question the finding says which reading the code's value is right under; a value right under none of
    them, or a manifest whose reading was measured, gets the plain finding."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    src = """\
        import torch_npu

        def forward(q, k, v, forward_metadata, block_table):
            return torch_npu.npu_fused_infer_attention_score_v2(
                q, k, v, num_query_heads=64, num_key_value_heads=8, input_layout="TND", softmax_scale=0.125,
                atten_mask=forward_metadata.attention_mask, sparse_mode=4, pre_tokens={pre},
                next_tokens=0, block_table=block_table, block_size=128)
    """
    exclusive = manifest("gpt_oss_20b")
    (window,) = {layer.sliding_window for layer in exclusive.layers if layer.sliding_window}
    (said,) = _kv806(src.format(pre=window), exclusive)
    assert f"reading 'exclusive' ({window} is right under 'inclusive'" in said and "kvcache probe" in said
    (said,) = _kv806(src.format(pre=window + 5), exclusive)  # right under no reading
    assert "inclusive" not in said
    inclusive = analyze(AnalyzeRequest(config=str(CONFIGS / "gpt_oss_20b.json"), framework_api="G2",
                                       window_reading="inclusive"))
    assert _kv806(src.format(pre=window), inclusive) == []
    (said,) = _kv806(src.format(pre=window - 1), inclusive)
    assert f"({window - 1} is right under 'exclusive'" in said
    measured = exclusive.model_copy(update={"device_dependencies": [
        d.model_copy(update={"status": "confirmed", "measured": "exclusive"}) if d.question == "window_pre_tokens"
        else d for d in exclusive.device_dependencies]})
    (said,) = _kv806(src.format(pre=window), measured)  # the device said 'exclusive': the code is wrong
    assert "inclusive" not in said


# ---------------------------------------------------------------- packed hidden states

HIDDEN_3D = """\
    {prelude}

    class DecoderLayer:
        def forward(self, hidden_states, forward_metadata, bsz, q_len):
            hidden_states = hidden_states.view(bsz, q_len, -1)
            {extra}
            return hidden_states
"""


@pytest.mark.parametrize("prelude, extra, expected", [
    ("from executor.core.kv_cache import CacheEntry", "", [("KV701", 5)]),
    # the framework's ForwardMetaData (any `executor.` import) is framework code too
    ("from executor.utils.forward_metadata import ForwardMetaData", "", [("KV701", 5)]),
    # standalone code (its own ForwardMetaData with one tensor per field) keeps its own [B, S, H] layout
    ("class ForwardMetaData: block_table: torch.Tensor", "", []),
    # framework mode on the Legacy (BSH) cache: the documented [B, S] shim
    ("from executor.core.kv_cache import CacheEntry",
     "torch_npu.scatter_update_(self.k_cache, forward_metadata.kv_len, hidden_states, 1)", []),
])
def test_hidden_states_view_only_in_packed_framework_code(prelude, extra, expected):
    assert rules(HIDDEN_3D.format(prelude=prelude, extra=extra)) == expected


def test_hidden_states_view_legacy_manifest():
    src = HIDDEN_3D.format(prelude="import torch", extra="")
    assert rules(src, manifest("qwen3_8b")) == [("KV701", 5)]
    assert rules(src, manifest("gemma2_9b")) == []  # soft-capping keeps gemma2 on the Legacy cache


# ---------------------------------------------------------------- MLA absorb vs expanded

MLA_PREFILL = """\
    import torch

    class LongcatFlashMLA(nn.Module):
        def __init__(self, config, tp):
            self.num_heads_per_rank = config.num_attention_heads // tp
            self.num_key_value_heads = config.num_key_value_heads

        def _forward_prefill(self, q_nope, q_pe, k_nope_out, v_out, k_rope, forward_metadata):
            return torch.ops.npu.npu_fused_infer_attention_score(
                q_nope, {key}, {value}, query_rope=q_pe, key_rope=k_rope,
                num_heads=self.num_heads_per_rank, {kv_heads}
                input_layout="NTD_TND", atten_mask=forward_metadata.attention_mask, sparse_mode=3)
"""


def test_mla_non_absorb_prefill_has_per_head_kv():
    # expanded K/V (kv_b_proj applied): num_key_value_heads = query heads is right, layout is its own
    for kv_heads in ("num_key_value_heads=self.num_heads_per_rank,", ""):
        src = MLA_PREFILL.format(key="k_nope_out", value="v_out", kv_heads=kv_heads)
        assert rules(src) == []
        # against DeepSeek-V3's manifest: v1 instead of v2 and no scale, but no layout (KV804) complaint
        assert rules(src, manifest("deepseek_v3")) == [("KV802", 9), ("KV803", 9)]


def test_mla_absorb_call_needs_one_kv_head():
    src = MLA_PREFILL.format(key="self.nope_cache", value="self.nope_cache",
                             kv_heads="num_key_value_heads=self.num_key_value_heads,")
    assert rules(src) == [("KV502", 11)]
    assert rules(src.replace("num_key_value_heads=self.num_key_value_heads,", "num_key_value_heads=1,")) == []


def test_phase_words_not_substrings():
    # "decoder" is not the decode phase: MLA absorb with mode 3 is only wrong at decode
    src = """\
        import torch_npu

        class Attn:
            def {name}(self, q, cache, q_pe, k_pe):
                return torch_npu.npu_fused_infer_attention_score_v2(
                    q, cache, cache, query_rope=q_pe, key_rope=k_pe, num_key_value_heads=1,
                    atten_mask=self.mask, sparse_mode=3)
    """
    assert rules(src.format(name="decoder_block_attention")) == []
    assert rules(src.format(name="forward_decode")) == [("KV203", 7)]


def test_nested_branches_sliding_then_phase():
    # Legacy mixed model: sliding layers band 4; full layers 3 at prefill, 0 without mask at decode
    src = """\
        import torch_npu

        class Gemma2Attention:
            def legacy_attention(self, q, forward_metadata):
                if self.attn_type == "SlidingWindow":
                    sparse_mode = {sliding}
                    atten_mask = forward_metadata.attention_mask
                else:
                    if forward_metadata.is_prefill:
                        sparse_mode = {prefill}
                        atten_mask = {prefill_mask}
                    else:
                        sparse_mode = 0
                        atten_mask = None
                return torch_npu.npu_fused_infer_attention_score(
                    q, self.k_cache, self.v_cache, atten_mask=atten_mask, sparse_mode=sparse_mode)
    """
    good = dict(sliding=4, prefill=3, prefill_mask="forward_metadata.attention_mask")
    assert rules(src.format(**good)) == []
    assert rules(src.format(**{**good, "prefill": 0, "prefill_mask": "None"})) == [("KV201", 10)]
    assert rules(src.format(**{**good, "sliding": 0})) == [("KV202", 6)]


# ---------------------------------------------------------------- values through helpers, dicts, early exits

HELPER = """\
    import torch_npu

    class Attn:
        def forward(self, q, k, v, forward_metadata):
            {body}

        def _fa(self, q, k, v, mode{default}, mask{mask_default}):
            return torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=8, input_layout="TND",
                                                             atten_mask=mask, sparse_mode=mode)
"""


@pytest.mark.parametrize("body, default, mask_default, expected", [
    # prefill call site passes mode 0 and no mask: reported at the call site
    ("if forward_metadata.is_prefill:\n                return self._fa(q, k, v, 0, None)\n"
     "            return self._fa(q, k, v, 0, None)", "", "", [("KV201", 6)]),
    # the defaults apply when the call site does not pass them
    ("if forward_metadata.is_prefill:\n                return self._fa(q, k, v)\n"
     "            return self._fa(q, k, v, 0, None)", "=0", "=None", [("KV201", 9)]),
    # values of two different calls are never combined: (0 with a mask) and (3 without) are both legal
    ("if forward_metadata.is_prefill:\n                a = self._fa(q, k, v, 0, forward_metadata.mask)\n"
     "                return self._fa(q, k, v, 3, None)\n            return self._fa(q, k, v, 0, None)",
     "", "", []),
    # decode-only call sites: mode 0 without a mask is right there
    ("if not forward_metadata.is_prefill:\n                return self._fa(q, k, v, 0, None)\n"
     "            return self._fa(q, k, v, 3, forward_metadata.mask)", "", "", []),
])
def test_values_follow_helper_arguments_per_call(body, default, mask_default, expected):
    assert rules(HELPER.format(body=body, default=default, mask_default=mask_default)) == expected


def test_code_after_an_early_return_runs_in_the_other_phase():
    src = """\
        import torch_npu

        class Attn:
            def forward(self, q, k, v, forward_metadata):
                if not forward_metadata.is_prefill:
                    return self.decode(q, k, v)
                return torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=8, input_layout="TND",
                                                                 sparse_mode=0)
    """
    assert rules(src) == [("KV201", 8)]  # at the literal
    # an early return under a condition the linter does not understand decides nothing
    assert rules(src.replace("not forward_metadata.is_prefill", "self.fast_path")) == []


@pytest.mark.parametrize("extra, expected", [
    ("", [("KV202", 7)]),
    # the dict is changed in a way not followed: its keys are unknown, nothing is reported
    ("kw.update(self.extra)", []),
    # a later write on the decode branch overrides the literal there
    ("if not forward_metadata.is_prefill:\n                    kw['sparse_mode'] = 4", []),
])
def test_star_kwargs_dict_is_opened(extra, expected):
    src = f"""\
        import torch_npu

        class SlidingAttn:
            def forward(self, q, k, v, forward_metadata):
                kw = dict(num_heads=8, input_layout="TND", atten_mask=forward_metadata.mask, pre_tokens=127,
                          next_tokens=0)
                kw["sparse_mode"] = 4 if forward_metadata.is_prefill else 0
                {extra}
                return torch_npu.npu_fused_infer_attention_score(q, k, v, **kw)
    """
    assert rules(src) == expected


# ---------------------------------------------------------------- every value pattern, every route to the call

# (rule, class name, phase test the call runs under, fixed keywords, the argument, its bad value)
VALUE_PATTERNS = [
    ("KV201", "Attn", "forward_metadata.is_prefill", 'num_heads=8, input_layout="TND", atten_mask=None',
     "sparse_mode", "0"),
    ("KV202", "SlidingAttn", "not forward_metadata.is_prefill",
     'num_heads=8, input_layout="TND", atten_mask=forward_metadata.mask, pre_tokens=127, next_tokens=0',
     "sparse_mode", "0"),
    ("KV203", "MLAAttn", "not forward_metadata.is_prefill",
     'query_rope=q_pe, key_rope=k_pe, num_heads=16, num_key_value_heads=1, input_layout="TND", atten_mask=None',
     "sparse_mode", "3"),
    ("KV204", "Attn", "forward_metadata.is_prefill", 'num_heads=8, input_layout="TND", sparse_mode=3',
     "atten_mask", "torch.ones(2048, 2048, dtype=torch.float16)"),
    ("KV205", "Attn", "forward_metadata.is_prefill", 'num_heads=8, input_layout="TND", sparse_mode=3',
     "atten_mask", "torch.ones(4096, 4096, dtype=torch.bool)"),
    ("KV301", "Attn", "forward_metadata.is_prefill",
     'num_heads=8, input_layout="TND", sparse_mode=3, atten_mask=forward_metadata.mask',
     "block_table", "forward_metadata.block_table"),
    ("KV502", "MLAAttn", "not forward_metadata.is_prefill",
     'query_rope=q_pe, key_rope=k_pe, num_heads=16, input_layout="TND", sparse_mode=0',
     "num_key_value_heads", "16"),
]

_CALL = "torch_npu.npu_fused_infer_attention_score(q, kv, kv, {fixed}, {arg})"
ROUTES = {
    "direct": ("{call_direct}", ""),
    "local": ("value = {value}\n            return {call_local}", ""),
    "helper": ("return self._fa(q, q_pe, kv, k_pe, forward_metadata, {value})",
               "\n    def _fa(self, q, q_pe, kv, k_pe, forward_metadata, value):\n        return {call_local}\n"),
    "kwargs": ('kw = {{"{name}": {value}}}\n            return {call_kwargs}', ""),
}


def _route_source(rule, cls, test, fixed, name, value, route) -> str:
    body, helper = ROUTES[route]
    calls = {
        "call_direct": "return " + _CALL.format(fixed=fixed, arg=f"{name}={value}"),
        "call_local": _CALL.format(fixed=fixed, arg=f"{name}=value"),
        "call_kwargs": _CALL.format(fixed=fixed, arg="**kw"),
    }
    return (
        "import torch\nimport torch_npu\nfrom executor.core.kv_cache import CacheEntry\n\n\n"
        f"class {cls}:\n"
        "    def forward(self, q, q_pe, kv, k_pe, forward_metadata):\n"
        f"        if {test}:\n"
        "            " + body.format(value=value, name=name, **calls) + "\n"
        "        return None\n" + helper.format(**calls)
    )


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("pattern", VALUE_PATTERNS, ids=lambda p: p[0])
def test_pattern_caught_whatever_route_the_value_takes(pattern, route):
    rule = pattern[0]
    source = _route_source(*pattern, route)
    found = {r for r, _ in rules(source)}
    assert rule in found, source
    # the same source with the value fixed (the rule's own corrected value) is clean of that rule
    good = {"KV201": "3", "KV202": "4", "KV203": "0", "KV204": "torch.ones(2048, 2048, dtype=torch.bool)",
            "KV205": "torch.ones(2048, 2048, dtype=torch.bool)",
            "KV301": "forward_metadata.block_table[self.attn_type]", "KV502": "1"}[rule]
    fixed_source = _route_source(*pattern[:5], good, route)
    assert rule not in {r for r, _ in rules(fixed_source)}, fixed_source
