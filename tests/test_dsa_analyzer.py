"""DeepSeek sparse attention in the analyzer: the indexer key cache is decided, counted and never rendered densely.

Configs come from transformers' own config classes at their defaults (DeepSeek-V3.2 `deepseek_v32`, GLM-5
`glm_moe_dsa`: the published architectures). The expected cache entry is upstream deepseek_v3_2_exp's
`CacheEntry("indexer_key_cache", dim=index_head_dim, num_head=1)` beside the MLA nope/rope entries.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import saved_config
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.manifest import INDEXER_KEY_CACHE, SelectionManifest
from model_infer_kvcache.implementer.render import render_manifest

from model_infer_kvcache import cli as kvcache_cli

transformers = pytest.importorskip("transformers")


def _config(model_type: str, tmp: Path, **changes) -> Path:
    return saved_config(transformers.AutoConfig.for_model(model_type), tmp, model_type, **changes)


@pytest.mark.parametrize("model_type,heads", [("deepseek_v32", 64), ("glm_moe_dsa", 32)])
def test_dsa_configs_plan_mla_plus_an_indexer_key_cache(model_type, heads, tmp_path):
    cfg = transformers.AutoConfig.for_model(model_type)
    m = analyze(AnalyzeRequest(config=str(_config(model_type, tmp_path))))
    assert m.kv_mode.value == "paged" and m.mla.enabled and not m.blockers
    assert (m.dsa.index_topk, m.dsa.index_n_heads, m.dsa.index_head_dim) == (cfg.index_topk, heads, 128)
    assert m.dsa.indexer_layers == list(range(cfg.num_hidden_layers)) and m.dsa.shared_layers == []
    for layer in m.layers:
        assert [(c.name, c.dim, c.num_head) for c in layer.caches] == [
            ("nope_cache", cfg.kv_lora_rank, 1), ("rope_cache", cfg.qk_rope_head_dim, 1), (INDEXER_KEY_CACHE, 128, 1)]
    # The memory plan counts the indexer keys: (512 + 64 + 128) x 2 bytes per token and layer.
    per_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim) * 2
    assert m.memory.per_token_bytes == per_layer * (cfg.num_hidden_layers + m.model.num_mtp_layers)
    assert m.dsa.source.startswith("index_topk")


def test_a_hub_config_without_layer_types_is_recognised(tmp_path):
    """The published DeepSeek-V3.2 config.json has index_* fields and no layer_types."""
    m = analyze(AnalyzeRequest(config=str(_config("deepseek_v32", tmp_path, layer_types=None))))
    assert m.dsa is not None and len(m.dsa.indexer_layers) == m.model.num_layers


def test_shared_indexer_layers_keep_no_indexer_cache(tmp_path):
    n = transformers.AutoConfig.for_model("glm_moe_dsa").num_hidden_layers
    types = ["full" if i % 4 == 0 else "shared" for i in range(n)]
    m = analyze(AnalyzeRequest(config=str(_config("glm_moe_dsa", tmp_path, indexer_types=types))))
    assert m.dsa.shared_layers == [i for i in range(n) if i % 4]
    for layer in m.layers:
        assert (INDEXER_KEY_CACHE in [c.name for c in layer.caches]) == (layer.decoder_layer % 4 == 0)


def test_dense_mla_has_no_dsa_section(tmp_path):
    m = analyze(AnalyzeRequest(config=str(_config("deepseek_v3", tmp_path))))
    assert m.dsa is None and "dsa" not in json.loads(m.to_json())
    assert all(INDEXER_KEY_CACHE not in [c.name for c in layer.caches] for layer in m.layers)


@pytest.mark.parametrize("changes,words", [
    ({"indexer_types": ["shared"] * 78}, ["indexer_types[0]", "first layer"]),
    ({"indexer_types": ["full", "sparse"] + ["full"] * 76}, ["indexer_types[1]", "'full' or 'shared'"]),
    ({"indexer_types": ["full"] * 3}, ["indexer_types", "one indexer type per layer"]),
    ({"index_head_dim": 32}, ["index_head_dim", "qk_rope_head_dim"]),
    ({"index_topk": "2048"}, ["index_topk", "positive integer"]),
    ({"index_n_heads": None}, ["index_n_heads", "missing"]),
])
def test_malformed_dsa_fields_are_refused_by_name(changes, words, tmp_path):
    with pytest.raises(InputError) as info:
        analyze(AnalyzeRequest(config=str(_config("glm_moe_dsa", tmp_path, **changes))))
    for word in words:
        assert word in info.value.render()


def test_index_topk_without_mla_is_not_guessed(tmp_path):
    with pytest.raises(InputError) as info:
        analyze(AnalyzeRequest(config=str(_config("qwen3", tmp_path, index_topk=2048))))
    assert "index_topk" in info.value.render() and "MLA" in info.value.render()


def test_indexer_heads_are_replicated_across_attention_tp(tmp_path):
    """The top-k needs each key's score summed over all indexer heads: every rank runs all of them (upstream's
    ReplicatedLinear), so a head count attention TP cannot divide is no blocker."""
    m = analyze(AnalyzeRequest(config=str(_config("deepseek_v32", tmp_path, index_n_heads=48)), attn_tp_size=32))
    assert m.dsa.index_n_heads_per_rank == 48 and "all 48 indexer heads" in m.dsa.reason
    m = analyze(AnalyzeRequest(config=str(_config("deepseek_v32", tmp_path)), attn_tp_size=8))
    assert m.dsa.index_n_heads_per_rank == 64


def test_a_manifest_that_drops_the_indexer_cache_is_refused(tmp_path):
    """Negative control: a hand edit removing the indexer entry (the indexer would read keys nobody wrote)."""
    m = json.loads(analyze(AnalyzeRequest(config=str(_config("deepseek_v32", tmp_path)))).to_json())
    m["layers"][3]["caches"] = m["layers"][3]["caches"][:2]
    with pytest.raises(ValueError, match="decoder layer 3 runs its indexer but has no indexer_key_cache"):
        SelectionManifest.model_validate(m)
    m = json.loads(analyze(AnalyzeRequest(config=str(_config("deepseek_v3", tmp_path)))).to_json())
    m["layers"][0]["caches"].append({"name": INDEXER_KEY_CACHE, "dim": 128, "num_head": 1, "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="has an indexer_key_cache entry but runs no indexer"):
        SelectionManifest.model_validate(m)


def test_the_dsa_render_selects_keys_and_never_calls_dense_fa(tmp_path):
    """Rendered DSA attends through the indexer's selection only (tests/test_dsa_render.py validates it)."""
    m = analyze(AnalyzeRequest(config=str(_config("deepseek_v32", tmp_path))))
    attn = render_manifest(m).files["kvcache_attention.py"]
    assert "npu_lightning_indexer(" in attn and "npu_sparse_flash_attention(" in attn
    assert "npu_fused_infer_attention" not in attn
    assert "INDEX_TOPK = 2048" in attn and "sparse_count=INDEX_TOPK," in attn and "npu_rotary_mul" in attn


def test_render_refuses_shared_indexer_layers_in_one_line(tmp_path, capsys, monkeypatch):
    """GLM-5 layers that reuse the previous selection have no template: exit 2, one line, nothing written."""
    m = analyze(AnalyzeRequest(config=str(_config("glm_moe_dsa", tmp_path, indexer_types=["full", "shared"] * 39))))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.json").write_text(m.to_json(), encoding="utf-8")
    assert kvcache_cli.main(["render", "--manifest", "m.json", "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dsa.shared_layers" in err and "reuse the previous layer's top-k" in err
    assert not (tmp_path / "out").exists()


def test_the_decisions_table_names_the_indexer_cache(tmp_path):
    from model_infer_kvcache.analyzer.decisions_table import decisions_markdown

    text = decisions_markdown(analyze(AnalyzeRequest(config=str(_config("deepseek_v32", tmp_path)))))
    row = next(line for line in text.splitlines() if line.startswith("| DSA"))
    assert "index_topk=2048" in row and "indexer_key_cache 128x1 bfloat16" in row


def test_the_upstream_config_class_plans_the_upstream_cache_entries(tmp_path):
    """Not developed against: deepseek_v3_2_exp's own config class (its defaults) gives the entries its model
    declares (modeling_deepseek.py cache_entries, unquantized: nope_cache kv_lora_rank, indexer_key_cache
    index_head_dim, rope_cache qk_rope_head_dim, each one head)."""
    import importlib.util

    from shared_dirs import shared_path

    path = shared_path("upstream", "cann-recipes-infer", "models", "deepseek_v3_2_exp", "models",
                       "configuration_deepseek.py")
    spec = importlib.util.spec_from_file_location("upstream_dsv32_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.DeepseekV3IndexConfig()
    data = {**cfg.to_dict(), "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(data, default=str), encoding="utf-8")
    m = analyze(AnalyzeRequest(config=str(tmp_path / "config.json")))
    want = {("nope_cache", cfg.kv_lora_rank, 1), (INDEXER_KEY_CACHE, cfg.index_head_dim, 1),
            ("rope_cache", cfg.qk_rope_head_dim, 1)}
    assert all({(c.name, c.dim, c.num_head) for c in layer.caches} == want for layer in m.layers)
    assert m.dsa.index_topk == cfg.index_topk and not m.blockers


@pytest.mark.parametrize("family, layout", [("deepseek_v32", "half"), ("glm_moe_dsa", "interleave")])
def test_the_indexer_rope_layout_is_the_familys(tmp_path, family, layout):
    """DeepSeek-V3.2's indexer rotates half-split pairs, GLM-5's interleaved ones (transformers' indexers): the
    render applies the manifest's, and the other would select other keys."""
    m = analyze(AnalyzeRequest(config=str(_config(family, tmp_path))))
    assert m.dsa.index_rope == layout and ("half-split" if layout == "half" else "interleaved") in m.dsa.key_transform


def test_an_indexer_of_an_unknown_family_is_not_guessed(tmp_path):
    """index_topk on an MLA family whose indexer kvcache does not know: its RoPE layout is code, not config."""
    with pytest.raises(InputError) as info:
        analyze(AnalyzeRequest(config=str(_config("deepseek_v3", tmp_path, index_topk=2048, index_n_heads=64,
                                                  index_head_dim=128))))
    assert "model_type" in info.value.render() and "deepseek_v32" in info.value.render()


# A.X-K2 at MLA's FA rope dim (its class default, rope 32, is held to MLA's FA dims: blocked); its latent 128 is kept
AXK2_ROPE_64 = {"qk_rope_head_dim": 64}


def test_axk2_plans_the_deepseek_v32_indexer(tmp_path):
    """A.X-K2's AXK2Indexer is DeepSeek-V3.2's unchanged (half-split RoPE on the first qk_rope_head_dim dims)."""
    cfg = transformers.AutoConfig.for_model("axk2")
    m = analyze(AnalyzeRequest(config=str(_config("axk2", tmp_path, **AXK2_ROPE_64))))
    assert m.kv_mode.value == "paged" and not m.blockers and m.dsa.index_rope == "half"
    assert (m.dsa.index_topk, m.dsa.index_n_heads, m.dsa.index_head_dim) == (2048, 16, 128)
    assert m.dsa.indexer_layers == list(range(cfg.num_hidden_layers)) and not m.dsa.dense_layers
    assert "axk2/modeling_axk2.py:AXK2Indexer.forward" in m.dsa.key_transform
    # the class defaults: MLA's dims rule, said to be the sparse-FA path's known dims (not an FA call)
    m = analyze(AnalyzeRequest(config=str(_config("axk2", tmp_path))))
    assert [f.fields for f in m.blockers] == [["qk_rope_head_dim"]]
    assert all("sparse-FA path is known at MLA's FA dims only" in f.message for f in m.blockers)


def test_dense_layer_types_beside_indexed_ones_are_planned_per_layer(tmp_path, capsys, monkeypatch):
    """'sliding_attention' beside 'indexed_attention' (Dots3-Note's layout: Dots3NoteTextAttention builds its
    indexer on 'indexed_attention' layers only): those layers run no indexer and keep no indexer key cache; the
    render has no template mixing them and says so by field. A.X-K2 builds its indexer on every layer whatever its
    layer_types say: planned so (the cross-check compares each module's indexer with the plan)."""
    cfg = transformers.AutoConfig.for_model("axk2")
    types = ["full_attention" if i % 3 == 2 else "indexed_attention" for i in range(cfg.num_hidden_layers)]
    m = analyze(AnalyzeRequest(config=str(_config("axk2", tmp_path, layer_types=types, **AXK2_ROPE_64))))
    assert not m.dsa.dense_layers and m.dsa.indexer_layers == list(range(cfg.num_hidden_layers))
    n = transformers.AutoConfig.for_model("dots3_note_text").num_hidden_layers
    path = tmp_path / "dots3.json"  # the sliding layers' latent at FA's 512 (the class default 1024 is a blocker)
    path.write_text(json.dumps(transformers.Dots3NoteTextConfig(swa_kv_lora_rank=512).to_dict(), default=str))
    m = analyze(AnalyzeRequest(config=str(path)))
    dense = [i for i in range(n) if i >= 2 and i % 4 != 1]  # Dots3NoteTextConfig: layers 0, 1 and i % 4 == 1 indexed
    assert m.dsa.dense_layers == dense and m.dsa.shared_layers == []
    assert m.dsa.indexer_layers == [i for i in range(n) if i not in dense]
    for layer in m.layers:
        assert (INDEXER_KEY_CACHE in [c.name for c in layer.caches]) == (layer.decoder_layer not in dense)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.json").write_text(m.to_json(), encoding="utf-8")
    assert kvcache_cli.main(["render", "--manifest", "m.json", "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dsa.dense_layers" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("family, words", [
    # learnable sinks in the sparse attention: torch_npu 2.14.0's sparse FA declares a sinks input (undocumented),
    # 2.9.0 returns the softmax statistics to apply one after: kvcache's gap, not the device's
    ("hy_v4", ["not supported by kvcache", "HYV4Attention.sinks", "Tensor? sinks=None",
               "npu_native_functions_by_codegen.yaml:978", "'shared'"]),
    # GQA with a weightless pool + top-k + sink/local selection: not the lightning indexer's top-k
    ("kolibri1_1", ["no pinned torch_npu op serves it", "Kolibri1_1Indexer.select_pool", "npu_lightning_indexer",
                    "_op_plugin_docs.py:1371", "no pool stage"]),
])
def test_indexed_families_the_device_or_kvcache_cannot_serve_are_refused_by_name(tmp_path, family, words):
    with pytest.raises(InputError) as info:
        analyze(AnalyzeRequest(config=str(_config(family, tmp_path))))
    for word in words:
        assert word in info.value.render()


def test_the_indexer_family_table_matches_the_modeling_code():
    """Each INDEXER_FAMILIES row against the transformers function it cites: the RoPE helper it names is the one
    the indexer calls, and the rotated dims are split off first ([rot, pass]) or last ([pass, rot])."""
    import importlib
    import inspect

    from model_infer_kvcache.analyzer.config_loader import INDEXER_FAMILIES

    for model_type, fam in INDEXER_FAMILIES.items():
        path, func = fam.source.split(" ")[0].removeprefix("transformers/models/").split(":")
        module = importlib.import_module(f"transformers.models.{path.removesuffix('.py').replace('/', '.')}")
        cls, method = func.split(".")
        code = inspect.getsource(getattr(getattr(module, cls), method))
        interleave = "apply_rotary_pos_emb_interleave(q_rot" in code
        assert interleave == (fam.rope == "interleave"), model_type
        assert ("q_rot, q_pass = torch.split(q" in code) == (fam.rope_dims == "first"), model_type
        assert ("q_pass, q_rot = torch.split(q" in code) == (fam.rope_dims == "last"), model_type


def test_the_indexed_refusals_cite_the_op_lines_that_say_it():
    """The op lines the Kolibri-1.1 and HY-V4 refusals cite say what the refusals read off them."""
    from model_infer_kvcache.analyzer.config_loader import INDEXER_FAMILIES, NON_MLA_INDEXERS
    from shared_dirs import shared_path

    def line(version: str, *parts: str, number: int) -> str:
        return shared_path(f"torch_npu-{version}", "torch_npu", *parts).read_text(encoding="utf-8").splitlines()[
            number - 1]

    assert "_op_plugin_docs.py:1371, 2.9.0: :8752" in NON_MLA_INDEXERS["kolibri1_1"].device_refusal
    for version, number in (("2.14.0", 1371), ("2.9.0", 8752)):
        assert line(version, "_op_plugin_docs.py", number=number).startswith("custom.npu_lightning_indexer(query, key, "
                                                                             "weights, *")
    gap = INDEXER_FAMILIES["hy_v4"].kvcache_gap
    assert "npu_native_functions_by_codegen.yaml:978" in gap and "_meta_registrations.py:288" in gap
    schema = line("2.14.0", "csrc", "aten", "npu_native_functions_by_codegen.yaml", number=978)
    assert "func: npu_sparse_flash_attention(" in schema and "Tensor? sinks=None" in schema
    assert "return_softmax_lse=False, sinks=None" in line("2.14.0", "op_plugin", "meta", "_meta_registrations.py",
                                                          number=288)
    # Qwen4-Exp's QSA, planned on the ops its source cites (analyzer/kinds/qsa.py, tests/test_qsa_device_route.py)
    from model_infer_kvcache.analyzer.kinds.qsa import OP_DOCS

    assert OP_DOCS.endswith("_op_plugin_docs.py:1371, :1474, :1481; 2.9.0: :8752, :8854, :8861")
    for version, (li, sfa, indices) in (("2.14.0", (1371, 1474, 1481)), ("2.9.0", (8752, 8854, 8861))):
        assert line(version, "_op_plugin_docs.py", number=li).startswith("custom.npu_lightning_indexer(")
        assert line(version, "_op_plugin_docs.py", number=sfa).startswith("custom.npu_sparse_flash_attention(")
        doc = line(version, "_op_plugin_docs.py", number=indices)
        assert doc.startswith("sparse_indices") and "[Q_T, KV_N, sparse_size]" in doc and "有效值均在前半部分" in doc
