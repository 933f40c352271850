"""DeepSeek-V4 compressed attention (CSA / HCA) planned as a cache kind of its own (issue 38, step 1).

Sources the expectations come from, none of them kvcache's: transformers' ``DeepseekV4Config`` (its layer types and
defaults: the published architecture), its attention modules on the meta device (the cross-check), upstream
deepseek_v4's cache entries (names, managers, shapes written out here from ``_init_cache_entries``) and the real
framework's ``calculate_block_num`` from the pinned snapshot (the block counts). Window-only, HCA and CSA layers
render (tests/test_compressed_render.py, tests/test_csa_render.py); the checkout run refuses the kind.
"""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
import transformers
from cli_support import invoke
from model_infer_kvcache.analyzer import arch_check
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.config_loader import normalize_config
from model_infer_kvcache.analyzer.memory import GIB
from shared_dirs import ROOT, shared_path, upstream_head

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]  # V4-Flash: layers 0-1 window only, then CSA on even, HCA on odd layers
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _v4(tmp_path, flash: bool = False, **changes):
    data = transformers.DeepseekV4Config().to_dict()
    data["torch_dtype"] = "bfloat16"
    if flash:  # the legacy spelling published checkpoints ship: one ratio per layer, no layer_types
        data.pop("layer_types"), data.pop("compress_rates")
        data["compress_ratios"] = FLASH_RATIOS
    data.update(changes)
    path = tmp_path / ("flash.json" if flash else "v4.json")
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    return path


def _expected_kinds(path) -> list[str | None]:
    """Each layer's branch as transformers reads the same config (its own folding of the legacy spelling)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    data.pop("model_type", None)
    cfg = transformers.DeepseekV4Config(**{k: v for k, v in data.items() if k != "torch_dtype"})
    return [{"compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}.get(t)
            for t in cfg.layer_types]


@pytest.mark.parametrize("flash", [False, True], ids=["defaults", "v4_flash"])
def test_every_layer_has_its_window_branch_and_the_compressed_branch_transformers_builds(tmp_path, flash):
    path = _v4(tmp_path, flash)
    m = analyze(AnalyzeRequest(config=str(path)))
    kinds = _expected_kinds(path)
    assert [layer.compressed.kind if layer.compressed else None for layer in m.layers] == kinds
    if flash:
        assert m.compressed.window_only_layers == [0, 1] and kinds[2:4] == ["csa", "hca"]
    for layer, kind in zip(m.layers, kinds, strict=True):
        # the window branch: one shared K=V row per token (upstream win_kv, SlidingWindow, its own manager)
        assert layer.attn_type == "SlidingWindow" and layer.sliding_window == 128 and layer.group_key == "win_kv"
        assert [(c.name, c.dim, c.num_head) for c in layer.caches] == [("win_kv", 512, 1)]
        if kind is None:
            continue
        got = [(e.name, e.dim, e.num_head, e.dtype, e.manager_key, e.block_size, e.compress_ratio, e.sliding_window)
               for e in layer.compressed.entries]
        # upstream deepseek_v4 _init_cache_entries at block_size 128, unquantized caches
        want = {
            "csa": [("sfa_cmp_kv", [512], 1, "bfloat16", "c4a_cmp_kv", 512, 4, None),
                    ("li_cmp_kv", [128], 1, "bfloat16", "c4a_cmp_kv", 512, 4, None),
                    ("sfa_kv_state", [2, 512], 2, "float32", "c4a_cmp_state", 128, 1, 8),
                    ("li_kv_state", [2, 128], 2, "float32", "c4a_cmp_state", 128, 1, 8)],
            "hca": [("sfa_cmp_kv", [512], 1, "bfloat16", "c128a_cmp_kv", 16384, 128, None),
                    ("sfa_kv_state", [1, 512], 2, "float32", "c128a_cmp_state", 128, 1, 128)],
        }[kind]
        assert got == want
        assert layer.compressed.index_topk == (512 if kind == "csa" else None)
    assert not any("cross-check skipped" in w.message for w in m.warnings)
    assert all(c.startswith("met: ") for c in m.compressed.device_constraints)


def _flip(layer):
    """A realistic misreading: CSA and HCA ratios swapped (the legacy 4 / 128 read the other way round)."""
    other = {"csa": ("hca", 128), "hca": ("csa", 4)}[layer.compressed.kind]
    branch = layer.compressed.model_copy(update={"kind": other[0], "compress_ratio": other[1]})
    return layer.model_copy(update={"compressed": branch})


def test_the_cross_check_catches_swapped_ratios_and_a_dropped_branch(tmp_path):
    """Negative controls for the cross-check: the plan compared with transformers' own compressors."""
    path = _v4(tmp_path, flash=True)
    config = json.loads(path.read_text(encoding="utf-8"))
    m = analyze(AnalyzeRequest(config=str(path)))
    facts = normalize_config(config, str(path))
    scale = m.fa.softmax_scale

    clean = arch_check.cross_check(config, facts, m.layers, scale, m.fa.scale_derivation)
    assert clean.errors == [] and clean.checked_layers == 43

    swapped = [_flip(layer) if layer.compressed else layer for layer in m.layers]
    errors = arch_check.cross_check(config, facts, swapped, scale, m.fa.scale_derivation).errors
    assert len(errors) == 1 and "compressed branch: analyzer HCA at rate 128 vs transformers compress_rate 4" in \
        errors[0] and "on 41 layer(s), first layer 2" in errors[0], errors

    dense = [layer.model_copy(update={"compressed": None}) for layer in m.layers]  # planned as a plain sliding model
    errors = arch_check.cross_check(config, facts, dense, scale, m.fa.scale_derivation).errors
    assert len(errors) == 1 and "analyzer none (window only) vs transformers compress_rate 4" in errors[0], errors


def _real_block_num(m, concurrency, *, max_len=None, hbm_gb=None, ratio=1.0):
    """The pinned snapshot's own executor.core.kv_cache.cache_utils.calculate_block_num over the manifest's entries
    (as upstream deepseek_v4 registers them, the MTP layer's window entry merged in), with torch.npu's memory query
    answered by the budget."""
    from model_infer_kvcache.validators.harness import install_framework
    from model_infer_kvcache.validators.standins import device_standins

    with device_standins(), install_framework(framework_root=upstream_head()):
        from executor.core.kv_cache import cache_utils
        from executor.core.kv_cache.cache_info import CacheEntry, LayerCacheInfo, ModelCacheInfo

        layers = []
        for layer in m.layers:
            entries = [CacheEntry(cache_name="win_kv", attn_type="SlidingWindow", dim=512, num_head=1,
                                  dtype=torch.bfloat16, needs_block=True, block_size=m.block_size,
                                  manager_key="win_kv", sliding_window=128)]
            for e in layer.compressed.entries if layer.compressed else []:
                entries.append(CacheEntry(
                    cache_name=e.name, attn_type="SlidingWindow" if e.sliding_window else "FullAttention",
                    dim=e.dim if len(e.dim) > 1 else e.dim[0], num_head=e.num_head, dtype=DTYPES[e.dtype],
                    needs_block=True, block_size=e.block_size, manager_key=e.manager_key,
                    sliding_window=e.sliding_window, compress_ratio=e.compress_ratio))
            layers.append(LayerCacheInfo(layer_idx=layer.index, caches=entries))
        layers.append(LayerCacheInfo(layer_idx=len(layers), caches=[CacheEntry(  # the MTP layer: window only
            cache_name="win_kv", attn_type="SlidingWindow", dim=512, num_head=1, dtype=torch.bfloat16,
            needs_block=True, block_size=m.block_size, manager_key="win_kv", sliding_window=128)]))
        info = ModelCacheInfo(num_layers=len(layers), layer_infos=layers)
        total = (hbm_gb or 10 ** 6) * GIB
        infer = types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(batch_size_per_dp_rank=concurrency, mem_fraction_static=ratio,
                                                   max_prefill_tokens=1),
            model_config=types.SimpleNamespace(next_n=m.mtp.next_n or m.mtp.num_layers),
            parallel_config=types.SimpleNamespace(offline_prefill_dp_group_size=1))
        saved = getattr(torch.npu, "mem_get_info", None)
        torch.npu.mem_get_info = lambda: (total, total)
        try:
            return cache_utils.calculate_block_num(infer, info, offline_max_len=max_len)
        finally:
            torch.npu.mem_get_info = saved


def test_the_memory_plan_is_the_real_frameworks_block_math(tmp_path):
    path = _v4(tmp_path, flash=True)
    offline = analyze(AnalyzeRequest(config=str(path), max_len=40000, max_concurrency=3))
    assert offline.memory.blocks == _real_block_num(offline, 3, max_len=40000)
    budget = analyze(AnalyzeRequest(config=str(path), hbm_gb=24, kv_mem_ratio=0.9, max_concurrency=5, max_len=300000))
    assert budget.memory.blocks == _real_block_num(budget, 5, hbm_gb=24, ratio=0.9)
    # per token, one rank: CSA rows (512 + 128) x 2 B // 4, HCA 512 x 2 B // 128 (cache_utils' floor per entry)
    groups = {g.group_key: g for g in budget.memory.groups}
    assert groups["c4a_cmp_kv"].per_token_bytes == 21 * (1024 // 4 + 256 // 4)
    assert groups["c128a_cmp_kv"].per_token_bytes == 20 * (1024 // 128)
    assert groups["c128a_cmp_kv"].block_size == 128 * 128 and groups["c4a_cmp_kv"].compress_ratio == 4
    assert groups["win_kv"].num_layers == 44  # 43 layers and the MTP layer's window branch
    assert groups["c4a_cmp_state"].fixed_blocks and groups["c128a_cmp_state"].fixed_blocks


def test_a_million_token_context_fits_where_the_mla_latent_would_not(tmp_path):
    v4 = analyze(AnalyzeRequest(config=str(_v4(tmp_path, flash=True)), hbm_gb=16, kv_mem_ratio=1.0,
                                max_len=1 << 20))
    v3 = analyze(AnalyzeRequest(config=str(ROOT / "tests/fixtures/configs/deepseek_v3.json"), hbm_gb=16,
                                kv_mem_ratio=1.0, max_len=1 << 20))
    assert v4.memory.max_concurrency_at_max_len >= 1 and v3.memory.max_concurrency_at_max_len == 0
    # the figure: the compressed rows of one 1M-token request, rounded up to whole blocks, dominate what it holds
    csa_rows = math.ceil((1 << 20) / 512) * 128 * 21 * (512 + 128) * 2
    figure = v4.compressed.long_context
    held = int(figure.split(" GiB on one rank (")[1].split(" B")[0])
    assert csa_rows < held < csa_rows * 1.2 and "MLA latent" in figure


def test_shapes_the_fused_kernels_do_not_take_are_planned_and_flagged(tmp_path):
    """CPU validation shrinks the model (rates that cross group boundaries in short streams): planned, with each
    unmet kernel shape named (not refused: a torch path serves them)."""
    m = analyze(AnalyzeRequest(config=str(_v4(tmp_path, head_dim=64, sliding_window=8, index_topk=4,
                                               compress_rates={"compressed_sparse_attention": 2,
                                                               "heavily_compressed_attention": 8},
                                               num_attention_heads=4, q_lora_rank=32, index_n_heads=2,
                                               index_head_dim=16, partial_rotary_factor=0.25))))
    unmet = [c for c in m.compressed.device_constraints if c.startswith("NOT met")]
    assert len(unmet) == 5 and m.compressed.compress_rates == {"csa": 2, "hca": 8}
    csa = next(layer for layer in m.layers if layer.compressed and layer.compressed.kind == "csa")
    assert csa.compressed.entries[2].sliding_window == 4 and csa.compressed.entries[0].block_size == 256


@pytest.mark.parametrize("change, field, words", [
    ({"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 4}}, "compress_rates",
     "would collide"),
    ({"compress_rates": {"compressed_sparse_attention": 1, "heavily_compressed_attention": 128}}, "compress_rates",
     "an integer >= 2"),
])
def test_unusable_rates_are_refused_by_name(tmp_path, capsys, change, field, words):
    rc, out, err = invoke(["analyze", "--config", _v4(tmp_path, **change), "--out", tmp_path / "m.json"], capsys)
    assert rc == 2 and out == "" and not (tmp_path / "m.json").exists()
    assert f": {field}: " in err and words in err and err.count("\n") == 1, err


def test_an_unknown_legacy_ratio_is_refused_by_name(tmp_path, capsys):
    path = _v4(tmp_path, flash=True, compress_ratios=FLASH_RATIOS[:5] + [16] + FLASH_RATIOS[6:])
    rc, out, err = invoke(["analyze", "--config", path, "--out", tmp_path / "m.json"], capsys)
    assert rc == 2 and ": compress_ratios[5]: compress ratio 16:" in err and not (tmp_path / "m.json").exists()


def test_uncompressed_ratios_leave_the_model_as_it_is(tmp_path, capsys):
    """Negative control: ratios of 0 / 1 compress nothing; such a config is planned as the model it otherwise is."""
    data = json.loads((ROOT / "tests" / "fixtures" / "configs" / "deepseek_v3.json").read_text(encoding="utf-8"))
    data["compress_ratios"] = [0] * data["num_hidden_layers"]
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert invoke(["analyze", "--config", path, "--out", tmp_path / "m.json"], capsys)[0] == 0
    m = json.loads((tmp_path / "m.json").read_text(encoding="utf-8"))
    assert "compressed" not in m and m["mla"]["enabled"]


def test_v4_with_its_mtp_layer_renders_verify_steps(tmp_path, capsys):
    """DeepseekV4Config's defaults carry one MTP layer (next_n 1): the render serves its verify steps through the
    compressed branches (run and negative controls: tests/test_v4_mtp.py); the standalone runner's state ring is
    coff x ratio + next_n - 1 tokens (analyzer.kinds.compressed.state_ring_tokens)."""
    path = _v4(tmp_path)
    assert invoke(["analyze", "--config", path, "--dispatch", "部署模式：独立部署", "--next-n", "3",
                   "--out", tmp_path / "m.json"], capsys)[0] == 0
    rc, out, err = invoke(["render", "--manifest", tmp_path / "m.json", "--out", tmp_path / "r"], capsys)
    assert rc == 0, err
    text = (tmp_path / "r" / "kvcache_runner.py").read_text(encoding="utf-8")
    assert "HCA_STATE_RING = 130" in text and "CSA_STATE_RING = 10" in text


def test_upstream_deepseek_v4_in_the_real_engine_is_a_named_gap_not_a_model_failure(tmp_path, capsys):
    root = shared_path("upstream", "cann-recipes-infer", "models", "deepseek_v4").parent.parent
    rc, out, err = invoke(["validate", "--framework-root", root, "--model", "deepseek_v4", "--config",
                           _v4(tmp_path), "--no-sweep"], capsys)
    assert rc == 2 and "compressed: not supported by kvcache: DeepSeek-V4 compressed attention in the engine" in err
    assert "V202" not in out


def test_a_model_whose_blocks_hold_no_attention_is_refused_not_planned_as_attention(tmp_path, capsys, monkeypatch):
    """xLSTM (mLSTM blocks, no attention module): the cross-check used to be 'skipped' with a warning and the model
    planned as FullAttention on every layer. It is now planned as a state stack (its mLSTM family); a recurrence kvcache
    does not know (here xLSTM with that family unread) is refused, transformers building it without attention, never
    planned as attention."""
    from model_infer_kvcache.analyzer import config_loader

    path = tmp_path / "xlstm.json"
    path.write_text(json.dumps(transformers.xLSTMConfig().to_dict(), default=str), encoding="utf-8")
    rc, out, err = invoke(["analyze", "--config", path], capsys)
    assert rc == 0 and {layer["attn_type"] for layer in json.loads(out)["layers"]} == {"Mamba"}, err
    known = config_loader.family_of_linear
    monkeypatch.setattr(config_loader, "family_of_linear",
                        lambda get, model_type, *a: None if model_type == "xlstm" else known(get, model_type, *a))
    monkeypatch.setenv("KVCACHE_CACHE_DIR", "")
    rc, out, err = invoke(["analyze", "--config", path], capsys)
    assert rc == 2 and out == "" and "decoder block has no attention module" in err and "holding xLSTMLayer" in err, err


@pytest.mark.parametrize("edit, field", [
    (lambda m: m["layers"][3]["compressed"].update(compress_ratio=4), "layers[3].compressed.compress_ratio"),
    (lambda m: m["layers"][2].pop("compressed"), "layers[2].compressed"),
])
def test_a_hand_edited_branch_is_refused_naming_the_field(tmp_path, capsys, edit, field):
    """The manifest's invariant: a layer's branch and rate are the compressed section's (Flash: layer 2 CSA,
    layer 3 HCA)."""
    assert invoke(["analyze", "--config", _v4(tmp_path, flash=True), "--out", tmp_path / "m.json"], capsys)[0] == 0
    data = json.loads((tmp_path / "m.json").read_text(encoding="utf-8"))
    edit(data)
    (tmp_path / "m.json").write_text(json.dumps(data), encoding="utf-8")
    rc, out, err = invoke(["render", "--manifest", tmp_path / "m.json", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and f"{field}:" in err and "compressed" in err, err


def test_the_decisions_table_states_the_compressed_plan(tmp_path):
    """progress.md's decisions table (what the skill writes for the user) names the branches, the entries the
    framework registers, the kernels' constraints and the long-context figure, from the manifest."""
    from model_infer_kvcache.analyzer.decisions_table import decision_rows, decisions_markdown

    m = analyze(AnalyzeRequest(config=str(_v4(tmp_path, flash=True))))
    rows = {label: (value, reason) for label, value, reason in decision_rows(m)}
    assert rows["压缩注意力 (CSA / HCA)"][0].startswith("CSA 21 层 (m=4, top-512), HCA 20 层 (m=128), 仅窗口 2 层")
    entries = rows["压缩分支 cache_entries"][0]
    assert "li_cmp_kv [128]x1 bfloat16 (c4a_cmp_kv, block 512 token, ratio 4)" in entries
    assert "sfa_kv_state [1, 512]x2 float32 (c128a_cmp_state, block 128 token, window 128)" in entries
    assert rows["压缩算子设备约束"][0] == "全部满足" and "GiB" in rows["长上下文"][0]
    assert "压缩注意力 (CSA / HCA)" in decisions_markdown(m)
    shrunk = analyze(AnalyzeRequest(config=str(_v4(tmp_path, head_dim=64, sliding_window=8, index_topk=4,
                                                   num_attention_heads=4, q_lora_rank=32, index_n_heads=2,
                                                   index_head_dim=16, partial_rotary_factor=0.25))))
    value, reason = {r[0]: r[1:] for r in decision_rows(shrunk)}["压缩算子设备约束"]
    assert value == "4 项不满足(走 torch 路径)" and reason.count("NOT met") == 4


def test_legacy_is_refused_for_compressed_attention(tmp_path, capsys):
    """Negative control: asking a contiguous Legacy cache for a compressed model would plan a design nothing serves."""
    rc, out, err = invoke(["analyze", "--config", _v4(tmp_path), "--kv-mode", "legacy", "--out", tmp_path / "m.json"],
                          capsys)
    assert rc == 2 and "--kv-mode: kv mode legacy" in err and "compressed attention" in err, err
    assert not (tmp_path / "m.json").exists()


def test_a_module_holding_another_formats_parts_is_named_by_the_plans_format():
    """The cross-check reads every format's module facts; a plan whose format has none of them names what the module
    holds (negative control: a V4 attention module against a GQA plan), and a module holding none passes."""
    from model_infer_kvcache.analyzer.kinds import compressed, gqa

    layer = types.SimpleNamespace(compressed=None)
    off = gqa.FORMAT.hf_off(layer, {"compress_rate": 4, "index_topk": 512}, "DeepseekV4Attention")
    assert off and "compress_rate 4" in off and "index_topk 512" in off and off.startswith("gqa plan")
    assert gqa.FORMAT.hf_off(layer, {"compress_rate": None}, "X") is None  # an attribute that is no int: nothing held
    assert compressed.FORMAT.hf_off(layer, {}, "DeepseekV4Attention") is None  # a window-only layer: no compressor
