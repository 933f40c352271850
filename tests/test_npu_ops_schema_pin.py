"""Pin the emulated callables to the real torch-npu 2.9.0 schemas (op_schemas.json)."""

from __future__ import annotations

import ast
import inspect
import json
import re

import pytest
import torch
import yaml
from model_infer_kvcache.analyzer.operators.extract_schemas import extract
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS, FA_OPS, ROLES, keywords_of
from model_infer_kvcache.analyzer.operators.schemas import (
    EMULATED_OPS,
    RELEASES,
    accepted_keywords,
    count_returns,
    emulated_ops_in,
    load_schemas,
    parse_func_schema,
    schema_default_to_python,
    schema_release,
)
from model_infer_kvcache.validators.npu_ops import emulated
from shared_dirs import shared_path, torch_npu_files

# Emulated operators the pinned release (2.9.0) does not define: pinned to the release that adds them.
NEWER_THAN_PIN = {"npu_chunk_gated_delta_rule": "2.14.0"}


def _schema(op):
    return load_schemas(schema_release(op))["ops"][op]


def test_schema_file_covers_every_emulated_op():
    doc = load_schemas()
    assert doc["source"].startswith("torch-npu==2.9.0")
    assert set(EMULATED_OPS) == set(emulated.OPS)
    assert set(doc["ops"]) == set(emulated_ops_in("2.9.0")) == set(EMULATED_OPS) - set(NEWER_THAN_PIN)
    for release in RELEASES:  # every committed release holds exactly the emulated operators it defines
        assert set(load_schemas(release)["ops"]) == set(emulated_ops_in(release)), release
    assert {op: schema_release(op) for op in NEWER_THAN_PIN} == NEWER_THAN_PIN


@pytest.mark.parametrize("op", EMULATED_OPS)
def test_signature_matches_schema(op):
    schema = _schema(op)
    params = list(inspect.signature(emulated.OPS[op]).parameters.values())
    assert [p.name for p in params] == [a["name"] for a in schema["args"]]
    for param, arg in zip(params, schema["args"], strict=True):
        expected_kind = inspect.Parameter.KEYWORD_ONLY if arg["kwarg_only"] else inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert param.kind == expected_kind, param.name
        if arg["default"] is None:
            assert param.default is inspect.Parameter.empty, param.name
        else:
            assert param.default == schema_default_to_python(arg["default"]), param.name
            assert type(param.default) is type(schema_default_to_python(arg["default"])), param.name


@pytest.mark.parametrize("op", EMULATED_OPS)
def test_json_args_are_the_parse_of_the_raw_func_string(op):
    schema = _schema(op)
    parsed = parse_func_schema(schema["func"])
    assert parsed["name"] == op
    assert parsed["args"] == schema["args"] and parsed["returns"] == schema["returns"]


# One valid call per model-side operator (norms, rotary, activations, formats, MoE, matmuls).
MODEL_OP_CALLS = {
    "npu_rms_norm": lambda f: f(torch.randn(3, 8), torch.ones(8)),
    "npu_add_rms_norm": lambda f: f(torch.randn(3, 8), torch.randn(3, 8), torch.ones(8)),
    "npu_apply_rotary_pos_emb": lambda f: f(torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.ones(4, 1, 8),
                                            torch.zeros(4, 1, 8), "TND"),
    "npu_interleave_rope": lambda f: f(torch.randn(1, 2, 4, 8), torch.ones(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)),
    "npu_swiglu": lambda f: f(torch.randn(3, 8)),
    "npu_geglu": lambda f: f(torch.randn(3, 8)),
    "npu_rotary_mul": lambda f: f(torch.randn(1, 4, 2, 8), torch.ones(1, 4, 1, 8), torch.zeros(1, 4, 1, 8)),
    "npu_format_cast": lambda f: f(torch.randn(3, 8), 29),
    "npu_moe_gating_top_k_softmax": lambda f: f(torch.randn(3, 4), None, k=2),
    "npu_moe_gating_top_k": lambda f: f(torch.randn(3, 16), 2, bias=torch.zeros(16), k_group=2, group_count=4,
                                        group_select_mode=1, norm_type=1),
    "npu_moe_init_routing": lambda f: f(torch.randn(3, 8), torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32),
                                        torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32), 3),
    "npu_moe_compute_expert_tokens": lambda f: f(torch.tensor([0, 1, 1], dtype=torch.int32), 3),
    "npu_moe_finalize_routing": lambda f: f(torch.randn(4, 8), None, None, None, torch.ones(2, 2),
                                            torch.arange(4, dtype=torch.int32), None),
    "npu_moe_init_routing_v2": lambda f: f(torch.randn(2, 8), torch.tensor([[0, 1], [1, 2]], dtype=torch.int32),
                                           active_num=4, expert_num=3, expert_tokens_num_type=1,
                                           expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, 3]),
    "npu_grouped_matmul": lambda f: f([torch.randn(4, 8)], [torch.randn(2, 8, 6)],
                                      group_list=torch.tensor([1, 4]), split_item=3, group_type=0),
    "npu_transpose_batchmatmul": lambda f: f(torch.randn(4, 2, 8), torch.randn(2, 8, 5), perm_x1=[1, 0, 2],
                                             perm_y=[1, 0, 2]),
    "npu_moe_re_routing": lambda f: f(torch.randn(3, 8), torch.tensor([[1, 2]])),
    "npu_moe_distribute_dispatch_v2": lambda f: f(torch.randn(2, 8), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32),
                                                  "ep", 1, 0, 2),
    "npu_moe_distribute_combine_v2": lambda f: f(torch.randn(4, 8), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32),
                                                 torch.tensor([0, 2, 3, 1], dtype=torch.int32),
                                                 torch.tensor([2, 2], dtype=torch.int32), torch.ones(2, 2), "ep", 1, 0,
                                                 2),
    "npu_mla_prolog_v3": lambda f: f(torch.randn(2, 8), torch.randn(8, 4), torch.randn(4, 1 * 192), torch.randn(1, 128, 512),
                                     torch.randn(8, 576), torch.ones(4), torch.ones(512), torch.zeros(2, 64),
                                     torch.ones(2, 64), torch.zeros(1, 16, 1, 512), torch.zeros(1, 16, 1, 64),
                                     cache_index=torch.tensor([0, 1])),
    "npu_lightning_indexer": lambda f: f(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 2),
                                         sparse_count=2),
    "npu_sparse_flash_attention": lambda f: f(torch.randn(1, 2, 2, 8), *(torch.randn(1, 3, 1, 8),) * 2,
                                              torch.tensor([[[[0, 1]], [[2, -1]]]], dtype=torch.int32), 0.5),
    "npu_recurrent_gated_delta_rule": lambda f: f(*(torch.randn(3, 1, 8, dtype=torch.float64),) * 2,
                                                  torch.randn(3, 2, 4, dtype=torch.float64),
                                                  torch.zeros(4, 2, 4, 8, dtype=torch.float64),
                                                  beta=torch.rand(3, 2, dtype=torch.float64), scale=0.5,
                                                  actual_seq_lengths=torch.tensor([1, 2], dtype=torch.int32),
                                                  ssm_state_indices=torch.tensor([3, 0, 1], dtype=torch.int32)),
    "npu_chunk_gated_delta_rule": lambda f: f(*(torch.randn(3, 1, 128, dtype=torch.float64),) * 2,
                                              torch.randn(3, 2, 128, dtype=torch.float64),
                                              beta=torch.rand(3, 2, dtype=torch.float64),
                                              initial_state=torch.zeros(2, 2, 128, 128, dtype=torch.float64),
                                              actual_seq_lengths=torch.tensor([1, 2], dtype=torch.int32), scale=0.5),
}
# Keywords of the schema that the doc's prototype line (接口原型) of the pinned release does not list yet, each
# described in the same entry's parameter list (参数说明): npu_mla_prolog_v3's prototype predates them.
DOC_PROTOTYPE_LAGS = {"npu_mla_prolog_v3": {"actual_seq_len", "k_nope_clip_alpha", "query_norm_flag", "weight_quant_mode",
                                            "kv_cache_quant_mode", "query_quant_mode", "ckvkr_repo_mode",
                                            "quant_scale_repo_mode", "tile_size"}}


def _minimal_call(op):
    if op in MODEL_OP_CALLS:
        return MODEL_OP_CALLS[op](emulated.OPS[op])
    q = torch.randn(2, 2, 16)
    if op.startswith("npu_fused_infer_attention_score"):
        kw = keywords_of(op)
        return emulated.OPS[op](q, q, q, input_layout="TND", **{kw.num_heads: 2, kw.q_lens: [2], kw.kv_lens: [2]})
    if "scatter_nd" in op:
        return emulated.OPS[op](torch.zeros(3, 2), torch.tensor([[1]]), torch.ones(1, 2))
    if "scatter_update" in op:
        return emulated.OPS[op](torch.zeros(2, 4, 2), torch.tensor([0, 1]), torch.ones(2, 1, 2), 1)
    kv = torch.randn(1, 1, 1, 48)
    return emulated.OPS[op](kv, torch.ones(32), torch.ones(1, 1, 1, 16), torch.zeros(1, 1, 1, 16),
                            torch.tensor([0]), torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 32), cache_mode="PA")


@pytest.mark.parametrize("op", EMULATED_OPS)
def test_return_arity_matches_schema(op):
    result = _minimal_call(op)
    returns = _schema(op)["returns"]
    expected = count_returns(returns)
    if returns == "Tensor[]":
        assert isinstance(result, list) and all(isinstance(t, torch.Tensor) for t in result)
    elif expected == 1:
        assert isinstance(result, torch.Tensor)
    else:
        assert isinstance(result, tuple) and len(result) == expected


def test_version_specific_keyword_names():
    # Each renamed argument is accepted by its own version only (the v1/v2 table of analyzer.operators.fa_facts).
    v1, v2 = (accepted_keywords(FA_OPS[version]) for version in ("v1", "v2"))
    for role in ROLES:
        assert getattr(FA_KEYWORDS["v1"], role) in v1 - v2 and getattr(FA_KEYWORDS["v2"], role) in v2 - v1, role
    assert "learnable_sink" in v2 - v1
    assert {"epsilon", "cache_mode", "is_output_kv"} <= accepted_keywords("npu_kv_rmsnorm_rope_cache")
    with pytest.raises(KeyError):
        accepted_keywords("npu_not_an_op")


def test_extractor_on_a_yaml_fragment():
    fragment = {
        "custom": [{"func": load_schemas()["ops"][op]["func"]} for op in emulated_ops_in("2.9.0")],
        "symint": [{"func": load_schemas()["ops"]["npu_fused_infer_attention_score"]["func"]}],
    }
    ops = extract(yaml.safe_dump(fragment), emulated_ops_in("2.9.0"))
    assert ops == load_schemas()["ops"]
    with pytest.raises(ValueError, match="npu_chunk_gated_delta_rule"):  # all of EMULATED_OPS: one is 2.14.0's
        extract(yaml.safe_dump(fragment))
    conflicting = dict(fragment, symint=[{"func": "npu_scatter_nd_update(Tensor self) -> Tensor"}])
    with pytest.raises(ValueError, match="conflicting"):
        extract(yaml.safe_dump(conflicting))
    with pytest.raises(ValueError, match="not found"):
        extract(yaml.safe_dump({"custom": fragment["custom"][:2]}), emulated_ops_in("2.9.0"))


def _wheel_files():
    """Root of the torch-npu 2.9.0 wheel layout in the shared folder (skips when absent)."""
    return torch_npu_files().parent


def test_committed_json_equals_fresh_extraction_from_wheel_yaml(tmp_path):
    from model_infer_kvcache.analyzer.operators.extract_schemas import main

    out = tmp_path / "schemas.json"
    assert main([str(_wheel_files()), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["ops"] == load_schemas()["ops"]


# Where the wheel's meta file differs from the schema (argument names only; order and count agree).
NO_META = {"npu_format_cast"}  # a storage-format op: no meta function in the 2.9.0 wheel
META_RENAMES = {
    "npu_swiglu": {"x": "self"},
    "npu_rotary_mul": {"embedding": "self", "cosine": "r1", "sine": "r2", "mode": "rotary_mode"},
    "npu_moe_compute_expert_tokens": {"sorted_experts": "sorted_expert_for_source_row", "num_experts": "num_expert"},
    "npu_moe_finalize_routing": {"skip2_optional": "skip2", "expert_for_source_row": "export_for_source_row"},
    "npu_transpose_batchmatmul": {"input_": "input"},
}
META_ALL_POSITIONAL = {"npu_moe_re_routing", "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2",
                       "npu_moe_gating_top_k"}
# Operators without a `torch_npu.<op>(...)` signature line in the 2.9.0 docs (their schema and meta
# function still pin them; the doc lines of npu_grouped_matmul and npu_moe_gating_top_k have neither
# the prefix nor types; npu_geglu's reads "torch_npu. npu_geglu(" and lacks activate_left).
UNDOCUMENTED = {"npu_kv_rmsnorm_rope_cache", "npu_kv_rmsnorm_rope_cache_v2", "npu_add_rms_norm",
                "npu_apply_rotary_pos_emb", "npu_interleave_rope", "npu_grouped_matmul", "npu_moe_re_routing",
                "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2", "npu_moe_gating_top_k",
                "npu_geglu",
                # "custom.npu_lightning_indexer(...)" / "custom.npu_sparse_flash_attention(...)": no torch_npu. prefix
                "npu_lightning_indexer", "npu_sparse_flash_attention",
                # prototype lines without the torch_npu. prefix ("npu_recurrent_gated_delta_rule(Tensor query, ...")
                "npu_recurrent_gated_delta_rule", "npu_chunk_gated_delta_rule"}


def _release_files(op):
    """The wheel files of the release the operator is pinned to (2.9.0, or the newer release adding it)."""
    release = schema_release(op)
    return torch_npu_files() if release == "2.9.0" else shared_path(f"torch_npu-{release}", "torch_npu")


def _meta_registrations(op) -> dict[str, list[ast.FunctionDef]]:
    """op name -> the functions the wheel's meta file registers for it (``@impl(m, "<op>")``)."""
    tree = ast.parse((_release_files(op) / "op_plugin" / "meta" / "_meta_registrations.py").read_text("utf-8"))
    found: dict[str, list[ast.FunctionDef]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and len(deco.args) == 2 and isinstance(deco.args[1], ast.Constant):
                    found.setdefault(deco.args[1].value, []).append(node)
    return found


@pytest.mark.parametrize("op", EMULATED_OPS)
def test_meta_registration_has_the_schema_arguments(op):
    # The meta function is what torch.compile / fake tensors call: same names, same keyword-only split.
    functions = _meta_registrations(op).get(op)
    if op in NO_META:
        assert not functions, f"{op} now has a meta registration: check it and drop it from NO_META"
        return
    assert functions, f"{op} has no meta registration in the wheel"
    args = _schema(op)["args"]
    for func in functions:
        positional = [a.arg for a in func.args.posonlyargs + func.args.args]
        keyword_only = [a.arg for a in func.args.kwonlyargs]
        if op in META_RENAMES:  # the meta function renames positional arguments (same count and order)
            positional = [META_RENAMES[op].get(name, name) for name in positional]
        if op in META_ALL_POSITIONAL:  # no keyword-only marker in the meta function: same names, same order
            assert positional + keyword_only == [a["name"] for a in args], func.name
            continue
        assert positional == [a["name"] for a in args if not a["kwarg_only"]], func.name
        # v1's meta function lists the keyword-only arguments in another order: compare as sets
        assert sorted(keyword_only) == sorted(a["name"] for a in args if a["kwarg_only"]), func.name


@pytest.mark.parametrize("op", EMULATED_OPS)
def test_documented_signature_has_the_schema_keywords(op):
    docs = (_release_files(op) / "_op_plugin_docs.py").read_text("utf-8")
    lines = re.findall(rf"^torch_npu\.({re.escape(op)}\(.*\) -> .*)$", docs, re.M)
    if not lines:
        assert op in UNDOCUMENTED, f"{op} undocumented"
        return
    assert op not in UNDOCUMENTED, f"{op} is documented now: drop it from UNDOCUMENTED"
    schema = _schema(op)["args"]
    for line in lines:
        untyped = re.fullmatch(r"\w+\(([\w, ]*)\) -> .*", line)
        if untyped:  # an untyped doc line (`npu_format_cast(self, acl_format)`): the required arguments
            assert len(untyped.group(1).split(",")) == len([a for a in schema if a["default"] is None]), line
            continue
        documented = parse_func_schema(line)["args"]
        lag = DOC_PROTOTYPE_LAGS.get(op, set())
        for name in lag:  # missing from the prototype line, described in the parameter list
            assert re.search(rf"^-\s+{name}（", docs.split(f'"{op}",', 1)[1].split('add_torch_npu_docstr', 1)[0], re.M), name
        # every keyword users can pass is documented with the schema's name; positional names differ
        # in the docs (`input`/`data` for the schema's `self`) and cannot be passed by keyword anyway
        assert {a["name"] for a in documented if a["kwarg_only"]} | lag == {a["name"] for a in schema if a["kwarg_only"]}
        assert len([a for a in documented if not a["kwarg_only"]]) == len([a for a in schema if not a["kwarg_only"]])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("op", sorted(MODEL_OP_CALLS))
def test_model_op_dispatches_through_torch_ops_npu_with_the_pinned_schema(op):
    from model_infer_kvcache.validators.npu_ops import install_emulation

    state = torch.random.get_rng_state()  # both calls draw the same random inputs
    with install_emulation():
        via_torch_ops = MODEL_OP_CALLS[op](getattr(torch.ops.npu, op))
    torch.random.set_rng_state(state)
    via_module = MODEL_OP_CALLS[op](emulated.OPS[op])
    assert _same(via_torch_ops, via_module)
