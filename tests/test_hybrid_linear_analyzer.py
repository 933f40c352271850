"""Hybrid linear-attention models: the analyzer plans one recurrent-state (Mamba) layer per linear layer of the
config, paged full layers beside them, and the memory of both; sizes checked by hand against the families' code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.decisions_table import decisions_markdown
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.linear_config import LIGHTNING, bailing_layer_kinds
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.analyzer.manifest_io import load_manifest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def run(name: str, **kw) -> SelectionManifest:
    return analyze(AnalyzeRequest(config=str(CONFIGS / f"{name}.json"), **kw))


def run_config(tmp_path: Path, cfg: dict, **kw) -> SelectionManifest:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return analyze(AnalyzeRequest(config=str(path), **kw))


def _linear_of(m: SelectionManifest) -> list[int]:
    return [layer.decoder_layer for layer in m.layers if layer.is_state]


def test_qwen3_5_moe_nested_text_config_plans_gated_delta_states():
    """Qwen3.5-MoE (transformers' Qwen3_5MoeConfig defaults, text_config nested): 30 of 40 layers linear."""
    m = run("qwen3_5_moe", attn_tp_size=4)
    lin = m.linear_attention
    assert m.kv_mode.value == "paged" and not m.blockers
    assert lin.family == "gated_delta_net" and _linear_of(m) == lin.layers == [i for i in range(40) if i % 4 != 3]
    # 16 key / 32 value heads of 128 over 4 ranks: conv (2 x 4 x 128 + 8 x 128) x 3, state 8 x 128 x 128
    assert [(s.name, s.shape) for s in lin.states] == [("conv_state", [2048, 3]), ("recurrent_state", [8, 128, 128])]
    assert lin.reference.startswith("transformers Qwen3NextGatedDeltaNet")
    assert not any("unknown model family" in w.message for w in m.warnings)  # qwen3_5: Qwen3's scale rule


def test_ling_2_5_is_lightning_attention_with_mla_full_layers_and_kvcache_s_own_reference():
    """Ling-2.5 publishes model_type bailing_hybrid, which transformers implements as Ling-3.0 (KDA): the lightning
    fields decide, the state is [H, D, D] without conv, the cross-check against the wrong model is skipped, and the
    validation reference is kvcache's own (transformers' Ling-family code with a torch lightning attention)."""
    m = run("ling_2_5", attn_tp_size=2)
    lin = m.linear_attention
    assert lin.family == LIGHTNING and lin.conv_kernel is None
    assert lin.reference.startswith("kvcache's Ling-2.5 reference (validators/pipeline/ling_lightning.py)")
    assert [(s.name, s.shape, s.dtype) for s in lin.states] == [("recurrent_state", [8, 128, 128], "bfloat16")]
    assert _linear_of(m) == [i for i in range(20) if (i + 1) % 5]
    assert m.mla.enabled and {c.name for layer in m.layers if not layer.is_state for c in layer.caches} == {
        "nope_cache", "rope_cache"}
    assert any("cross-check skipped" in w.message and "another architecture" in w.message for w in m.warnings)
    assert not m.blockers and m.kv_mode.value == "paged"


def test_ling_layer_groups_follow_each_architecture_s_own_code():
    """Ling-2.5's code also makes the layers after the last whole group full attention; transformers' KDA
    bailing_hybrid only the last layer of each group."""
    full = [i for i, k in enumerate(bailing_layer_kinds(5, 22, LIGHTNING)) if k == "full"]
    assert full == [4, 9, 14, 19, 20, 21]
    full = [i for i, k in enumerate(bailing_layer_kinds(5, 22, "kimi_delta_attention")) if k == "full"]
    assert full == [4, 9, 14, 19]


def test_kda_families_read_their_own_fields(tmp_path):
    """Ling-3.0 (transformers BailingHybridConfig defaults): H 32, the config's head_dim 128 (not the MLA rope dim
    transformers later overwrites it with), kernel 4; Kimi-Linear: linear_attn_config, 1-based layer lists."""
    m = run("bailing_hybrid_kda", attn_tp_size=2)
    lin = m.linear_attention
    assert lin.family == "kimi_delta_attention" and (lin.num_v_heads, lin.head_k_dim) == (32, 128)
    assert [(s.name, s.shape, s.dtype) for s in lin.states] == [
        ("conv_state", [3 * 16 * 128, 3], "bfloat16"), ("recurrent_state", [16, 128, 128], "float32"),
        ("state_anchor", [1], "int32")]  # its MTP layer: speculative state slots and their anchor
    assert _linear_of(m) == [i for i in range(42) if (i + 1) % 6]
    # the same model re-saved by transformers (head_dim overwritten with qk_rope_head_dim, linear_* added)
    from transformers import BailingHybridConfig

    resaved = BailingHybridConfig().to_dict()
    assert resaved["head_dim"] == 64 and resaved["linear_head_dim"] == 128
    path = tmp_path / "resaved.json"
    path.write_text(json.dumps(resaved))
    again = analyze(AnalyzeRequest(config=str(path), attn_tp_size=2)).linear_attention
    assert again.states == lin.states and again.layers == lin.layers
    kimi = run("kimi_linear")
    assert kimi.linear_attention.family == "kimi_delta_attention"
    # Kimi-Linear's MLA layers are NoPE: the RoPE the MLA writer applies would be wrong, said as a warning
    assert any("MLA without positional encoding" in w.message for w in kimi.warnings)
    assert not any("MLA without positional encoding" in w.message for w in m.warnings)  # Ling-3.0 rotates
    types = json.loads((CONFIGS / "kimi_linear.json").read_text())["layer_types"]  # KimiLinearConfig's own rule
    assert [i for i, layer in enumerate(kimi.layers) if not layer.is_state] == [
        i for i, t in enumerate(types) if t == "full_attention"] == [4, 8, 12, 16, 20, 24]


def test_kimi_linear_checkpoint_layer_lists_are_one_based(tmp_path):
    cfg = json.loads((CONFIGS / "kimi_linear.json").read_text())
    cfg.pop("layer_types")
    cfg["num_hidden_layers"] = 4
    cfg["linear_attn_config"] = {"num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4,
                                 "kda_layers": [1, 2, 3], "full_attn_layers": [4]}
    m = run_config(tmp_path, cfg)
    assert _linear_of(m) == [0, 1, 2] and m.linear_attention.num_v_heads == 4
    assert m.linear_attention.states[0].shape == [3 * 4 * 64, 3]
    cfg["linear_attn_config"]["full_attn_layers"] = [5]
    with pytest.raises(InputError) as info:
        run_config(tmp_path, cfg)
    assert info.value.field == "linear_attn_config.full_attn_layers[0]"


@pytest.mark.parametrize("extra, fields", [
    ({}, None),  # neither set of fields
    ({"group_norm_size": 4, "short_conv_kernel_size": 4}, None),  # both
])
def test_bailing_hybrid_the_config_cannot_tell_is_refused_by_name(tmp_path, extra, fields):
    cfg = json.loads((CONFIGS / "ling_2_5.json").read_text())
    for key in ("group_norm_size", "linear_silu", "architectures"):
        cfg.pop(key)
    cfg.update(extra)
    with pytest.raises(InputError) as info:
        run_config(tmp_path, cfg)
    assert info.value.field == "model_type" and "bailing_hybrid" in str(info.value)


def test_linear_heads_split_by_tp_or_refused(tmp_path):
    """Linear heads are split like attention heads (no replication): 4 key heads cannot split 8 ways even though
    the 16 attention heads can."""
    cfg = json.loads((CONFIGS / "qwen3_next.json").read_text())
    cfg.update(linear_num_key_heads=4, linear_num_value_heads=12, num_key_value_heads=8)
    with pytest.raises(InputError) as info:
        run_config(tmp_path, cfg, attn_tp_size=8)
    assert "4 linear-attention key heads are not divisible by attn_tp_size 8" in str(info.value)
    m = run_config(tmp_path, cfg, attn_tp_size=4)
    assert (m.linear_attention.num_k_heads_per_rank, m.linear_attention.num_v_heads_per_rank) == (1, 3)
    cfg.update(linear_num_value_heads=10)  # value heads must group evenly over key heads
    with pytest.raises(InputError) as info:
        run_config(tmp_path, cfg)
    assert info.value.field == "linear_num_value_heads"


def test_budget_reserves_the_state_blocks_before_the_paged_pool():
    """The framework reserves fixed (Mamba) groups first, then sizes the paged pool from the rest: by hand,
    2 GiB x 0.9 budget, 4 requests -> 5 state blocks of 36 layers' states, the rest in tokens of 12 full layers."""
    m = run("qwen3_next", attn_tp_size=2, hbm_gb=2, max_concurrency=4, max_len=4096)
    state = m.linear_attention.state_bytes_per_layer * 36
    budget = 2 * 1024**3 * 0.9
    tokens = int((budget - 5 * state) // m.memory.per_token_bytes)
    assert m.memory.blocks == {"Mamba": 5, "FullAttention": tokens // 128}
    assert m.memory.max_tokens == tokens
    assert any("Mamba: fixed 4 x (1 + 0) + 1 = 5 state blocks" in line for line in m.memory.derivation)


def test_decisions_table_names_the_state_layers_and_the_family():
    text = decisions_markdown(run("qwen3_next", attn_tp_size=2))
    assert "| Mamba (config: linear,循环状态) |" in text and "recurrent_state [16, 128, 128] bfloat16" in text
    assert "| 线性注意力(循环状态) | gated_delta_net, 36 层" in text and "MambaCacheEntry" in text


# ---------------------------------------------------------------- hand edits the manifest refuses (negative controls)


def _edited(edit) -> dict:
    data = json.loads(run("qwen3_next", attn_tp_size=2).to_json())
    edit(data)
    return data


def _first(data: dict, kind: str) -> dict:
    return next(layer for layer in data["layers"] if layer["layer_kind"] == kind)


@pytest.mark.parametrize("edit, field", [
    # a full-attention layer given a state entry
    (lambda d: _first(d, "full").update(states=d["linear_attention"]["states"]), "states"),
    # a linear layer given a KV cache
    (lambda d: _first(d, "linear").update(caches=_first(d, "full")["caches"]), "caches"),
    # a linear layer's state differing from the plan (conv state keeping K columns, not K - 1)
    (lambda d: _first(d, "linear")["states"][0].update(shape=[4096, 4]), "states"),
    # a linear layer retagged as full attention (its plan is still a state layer's: named by its attn_type)
    (lambda d: _first(d, "linear").update(attn_type="FullAttention", group_key="FullAttention"), "attn_type"),
    # a full layer retagged as a state layer
    (lambda d: _first(d, "full").update(attn_type="Mamba", group_key="Mamba"), "attn_type"),
    # a state layer given FA fields (schema 2.0: a state layer has none)
    (lambda d: _first(d, "linear").update(sparse_mode={"prefill": 3, "decode": 3}), "sparse_mode"),
    # per-rank heads not matching the TP split
    (lambda d: d["linear_attention"].update(num_v_heads_per_rank=32), "num_v_heads_per_rank"),
])
def test_hand_edits_that_break_the_state_plan_are_refused(tmp_path, edit, field):
    """Each edit is refused by the one manifest loader every command uses, naming the field to fix."""
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(_edited(edit)), encoding="utf-8")
    with pytest.raises(InputError) as info:
        load_manifest(path)
    assert info.value.field.endswith(field), info.value.field
    SelectionManifest.model_validate(_edited(lambda d: None))  # the unedited manifest loads


def test_cli_refuses_an_ambiguous_bailing_config_in_one_line(tmp_path):
    cfg = json.loads((CONFIGS / "ling_2_5.json").read_text())
    cfg["short_conv_kernel_size"] = 4
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "analyze", "--config", str(path),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not out.exists()
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: model_type:") and "group_norm_size" in lines[0]


def test_a_hybrid_with_mtp_is_planned_and_rendered_with_its_speculative_state_blocks(tmp_path):
    """Published Qwen3.5 configs carry one MTP layer: a request then holds 1 + next_n state blocks (the framework's
    Mamba group), the plan says how a verify step keeps them, and the render carries them (tests/test_hybrid_mtp.py
    validates it)."""
    from model_infer_kvcache.implementer.render import render_manifest

    cfg = json.loads((CONFIGS / "qwen3_5_moe.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    m = run_config(tmp_path, cfg, max_len=4096, max_concurrency=4)
    assert m.model.num_mtp_layers == 1 and m.memory.blocks["Mamba"] == 4 * (1 + 1) + 1
    assert m.linear_attention.state_blocks_per_request == 2 and "last accepted" in m.linear_attention.speculative
    assert not any("1 + next_n state blocks" in w.message for w in m.warnings)  # planned, nothing to warn of
    text = render_manifest(m).files["kvcache_attention.py"]
    assert "NEXT_N = 1" in text and "def resume_columns(" in text


def _rendered_code(manifest) -> dict[str, list[str]]:
    """The rendered files without their first line (it names the manifest's hash)."""
    from model_infer_kvcache.implementer.render import render_manifest

    return {name: text.splitlines()[1:] for name, text in render_manifest(manifest).files.items()}


def test_next_n_0_serves_a_hybrid_with_mtp_without_speculative_decoding(tmp_path):
    """--next-n 0 (the framework run with next_n 0): the MTP layer is left unused, so the plan and the render are
    those of the same config without it (one state block per request, no verify steps), and the manifest says so."""
    cfg = json.loads((CONFIGS / "qwen3_5_moe.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    off = run_config(tmp_path, cfg, max_len=4096, max_concurrency=4, next_n=0, deploy_mode="framework")
    assert off.mtp is None and off.model.num_mtp_layers == 0 and off.memory.blocks["Mamba"] == 4 * 1 + 1
    assert any(w.message.startswith("--next-n 0: speculative decoding off, the config's 1 MTP layer(s) unused")
               for w in off.warnings)
    del cfg["text_config"]["mtp_num_hidden_layers"]
    (tmp_path / "plain").mkdir()
    plain = run_config(tmp_path / "plain", cfg, max_len=4096, max_concurrency=4, deploy_mode="framework")
    assert off.layers == plain.layers and off.memory.blocks == plain.memory.blocks
    assert _rendered_code(off) == _rendered_code(plain)


@pytest.mark.parametrize("next_n, mtp, message", [(-1, 1, "must be 0 (off) or more"),
                                                  (2, 0, "the config has no MTP layer to draft them")])
def test_next_n_negative_or_without_mtp_layers_is_bad_input(tmp_path, next_n, mtp, message):
    cfg = json.loads((CONFIGS / "qwen3_5_moe.json").read_text())
    if mtp:
        cfg["text_config"]["mtp_num_hidden_layers"] = mtp
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "analyze", "--config", str(path), "--next-n",
                           str(next_n), "--out", str(out)], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and not out.exists() and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --next-n: ") and message in lines[0]


def test_next_n_deeper_than_the_mtp_layers_is_planned_as_the_framework_serves_it(tmp_path):
    """The MTP worker runs its layers next_n times (upstream deepseek yamls: next_n 3 with one MTP layer): the depth
    is recorded where it is not one per layer and sizes the verify steps and the state blocks; the default plan
    (one per layer) is unchanged, its JSON without the field."""
    cfg = json.loads((CONFIGS / "qwen3_5_moe.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    deep = analyze(AnalyzeRequest(config=str(path), next_n=3, max_concurrency=4, max_len=4096))
    assert (deep.mtp.num_layers, deep.mtp.next_n, deep.mtp.speculative_tokens) == (1, 3, 3)
    assert deep.linear_attention.state_blocks_per_request == 4 and deep.memory.blocks["Mamba"] == 4 * (1 + 3) + 1
    same = analyze(AnalyzeRequest(config=str(path), next_n=1))  # the config's depth: the default plan
    assert same == analyze(AnalyzeRequest(config=str(path))) and same.mtp.next_n is None
    assert '"next_n"' not in same.mtp.model_dump_json() and '"next_n":3' in deep.mtp.model_dump_json()
