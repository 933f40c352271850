"""What a new user trips on: one name per framework generation everywhere, and each attention kind shows the
decisions it has.

* G0..G3 are the cache_info API generations (G3 = HEAD era). G3 frameworks take the same model-side contract as
  G2 renders, so every flag that names a generation takes G3 too, the manifest then names G3, and a G3 render is
  the G2 code; no message calls G2 "the current" generation.
* DeepSeek sparse attention (``manifest.dsa``) attends through ``npu_sparse_flash_attention`` over the indexer's
  top-k keys, never through FA: its decisions table and INTEGRATION.md show that call, not the FA version, the FA
  input_layout or the FA path table's sparse_mode rows. A Legacy model that keeps its own eager attention calls
  no FA either. Check V206 is named for both calls.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_support import invoke, saved_config
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.decisions_table import decision_rows, decisions_markdown
from model_infer_kvcache.analyzer.framework_checkout import GENERATIONS, render_api
from model_infer_kvcache.implementer.render import render_manifest

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny_qwen3" / "config.json"
CONFIGS = ROOT / "tests" / "fixtures" / "configs"

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------ item 4: G2 vs G3


def _analyze_json(capsys, *flags) -> dict:
    rc, out, err = invoke(["analyze", "--config", TINY, "--deploy-mode", "framework", *flags], capsys)
    assert rc == 0, err
    return json.loads(out)


def test_analyze_takes_g3_and_the_manifest_names_it(capsys):
    m = _analyze_json(capsys, "--framework-api", "G3")
    assert m["framework_api"] == "G3"
    assert "G2" in m["framework_api_evidence"]  # what its renders follow, said once, in the evidence
    assert not any("generation unknown" in q["message"] for q in m["open_questions"])


def test_every_generation_flag_takes_every_generation():
    """analyze, render, run and validate name the same generations (G0..G3) in their --framework-api choices."""
    from model_infer_kvcache.analyzer.cli import build_parser as analyze_parser
    from model_infer_kvcache.implementer.cli import build_parser as render_parser
    from model_infer_kvcache.validators.cli import build_parser as validate_parser

    for parser in (analyze_parser(), render_parser(), validate_parser()):
        action = next(a for a in parser._actions if "--framework-api" in a.option_strings)
        assert tuple(action.choices) == GENERATIONS == ("G0", "G1", "G2", "G3"), parser.prog


def test_a_g3_render_is_the_g2_code(tmp_path, capsys):
    """`kvcache render --framework-api G3` writes the G2 contract's code byte for byte; only INTEGRATION.md names
    the generation the user gave."""
    unnamed = tmp_path / "unnamed.json"
    rc, _, err = invoke(["analyze", "--config", TINY, "--deploy-mode", "framework", "--out", unnamed], capsys)
    assert rc == 0, err
    outs = {}
    for gen in ("G2", "G3"):
        rc, _, err = invoke(["render", "--manifest", unnamed, "--framework-api", gen, "--out", tmp_path / gen], capsys)
        assert rc == 0, err
        outs[gen] = {p.name: p.read_text(encoding="utf-8") for p in sorted((tmp_path / gen).iterdir())}
    code = sorted(n for n in outs["G2"] if n.endswith(".py"))
    assert code and all(outs["G3"][n] == outs["G2"][n] for n in code)
    assert "framework API **G3**" in outs["G3"]["INTEGRATION.md"] and "G2" in outs["G3"]["INTEGRATION.md"]

    # a manifest that names G3 renders the same code (its own hash on line 1)
    named = {gen: analyze(AnalyzeRequest(config=str(TINY), deploy_mode="framework", framework_api=gen))
             for gen in ("G2", "G3")}
    files = {gen: render_manifest(m).files for gen, m in named.items()}
    for name in code:
        assert files["G3"][name].splitlines()[1:] == files["G2"][name].splitlines()[1:], name
    # an override naming the same contract is no contradiction; another contract is
    assert render_manifest(named["G3"], framework_api="G2").files[code[0]] == files["G3"][code[0]]
    with pytest.raises(Exception, match="contradicts"):
        render_manifest(named["G3"], framework_api="G1")


def test_a_checkout_and_a_flag_of_the_same_contract_agree_on_the_checkouts_name():
    """The framework_g2 fixture carries the HEAD-era fields (G3): --framework-api G2 names the same render contract,
    so the manifest keeps the checkout's G3 and says why; another contract still contradicts it."""
    from model_infer_kvcache.analyzer.errors import InputError

    root = str(ROOT / "tests" / "fixtures" / "framework_g2")
    m = analyze(AnalyzeRequest(config=str(CONFIGS / "qwen3_8b.json"), framework_root=root, framework_api="G2"))
    assert m.framework_api == "G3" and "--framework-api G2 names the same G2 render contract" in \
        m.framework_api_evidence
    assert analyze(AnalyzeRequest(config=str(CONFIGS / "qwen3_8b.json"), framework_root=root,
                                  framework_api="G3")).framework_api == "G3"
    with pytest.raises(InputError, match="contradicts the checkout's G3"):
        analyze(AnalyzeRequest(config=str(CONFIGS / "qwen3_8b.json"), framework_root=root, framework_api="G1"))


def test_the_decisions_table_names_g3_and_its_contract():
    m = analyze(AnalyzeRequest(config=str(TINY), deploy_mode="framework", framework_api="G3"))
    row = next(r for r in decision_rows(m) if r[0] == "框架 API 代际")
    assert row[1].startswith("G3") and "G2" in row[1] + row[2]


def test_no_message_calls_g2_the_current_generation():
    m = analyze(AnalyzeRequest(config=str(TINY), deploy_mode="framework"))
    question = next(q.message for q in m.open_questions if "generation unknown" in q.message)
    assert "current" not in question
    assert all(g in question for g in GENERATIONS)  # every generation the flag takes
    assert "G3" in question and "G2" in question  # renders follow G2's contract, which G3 frameworks take
    row = next(r for r in decision_rows(m) if r[0] == "框架 API 代际")
    assert "G3" in row[1]  # the unknown row says which frameworks the default render fits
    assert render_api("G3") == "G2" and [render_api(g) for g in GENERATIONS[:3]] == list(GENERATIONS[:3])


# ------------------------------------------------------------------------ item 7: each kind shows its decisions


FA_ROW_LABELS = ("FA 版本", "input_layout")


def _labels(m) -> list[str]:
    return [r[0] for r in decision_rows(m)]


@pytest.fixture(scope="module")
def dsa_manifest(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dsa")
    config = saved_config(transformers.AutoConfig.for_model("deepseek_v32"), tmp, "deepseek_v32")
    return analyze(AnalyzeRequest(config=str(config), deploy_mode="framework", framework_api="G3"))


def test_dsa_table_shows_the_sparse_call_not_fa_rows(dsa_manifest):
    from model_infer_kvcache.analyzer.operators.fa_facts import SPARSE_FA

    m = dsa_manifest
    labels = _labels(m)
    assert not [x for x in labels if x in FA_ROW_LABELS or x.startswith("sparse_mode / mask")], labels
    rows = dict((r[0], r) for r in decision_rows(m))
    sparse = next(r for r in decision_rows(m) if r[0].startswith("稀疏注意力调用"))
    assert SPARSE_FA.op in sparse[1] and f"sparse_mode {SPARSE_FA.sparse_mode}" in sparse[1]
    assert f"layout_query {SPARSE_FA.layout_query}" in sparse[1] and f"layout_kv {SPARSE_FA.layout_kv}" in sparse[1]
    assert f"index_topk={m.dsa.index_topk}" in sparse[1]
    assert "npu_fused_infer_attention_score" not in " ".join(" ".join(r) for r in decision_rows(m))
    # what is true for the sparse call stays: its scale, the MLA absorb, the DSA row
    assert rows["softmax scale"][1] == f"{m.fa.softmax_scale:.8g}"
    assert "MLA absorb" in rows and "DSA 稀疏注意力" in rows


def test_dsa_table_keeps_the_sparse_call_facts_of_the_render(dsa_manifest):
    """The table's call facts are the rendered call's keywords (one home: analyzer.operators.fa_facts)."""
    from model_infer_kvcache.analyzer.operators.fa_facts import SPARSE_FA

    code = render_manifest(dsa_manifest).files["kvcache_attention.py"]
    call = code[code.index(f"torch_npu.{SPARSE_FA.op}("):]
    call = call[:call.index("\n        )")]
    assert f'layout_query="{SPARSE_FA.layout_query}"' in call and f'layout_kv="{SPARSE_FA.layout_kv}"' in call
    assert f"sparse_mode={SPARSE_FA.sparse_mode}," in call


def test_dsa_integration_names_the_sparse_call_and_its_arguments(dsa_manifest):
    text = render_manifest(dsa_manifest).files["INTEGRATION.md"]
    assert "npu_fused_infer_attention_score" not in text and "FA **" not in text
    assert "npu_sparse_flash_attention" in text
    assert not re.search(r"^\| (FA 版本|input_layout|sparse_mode / mask)", text, re.M)
    # the rendered kv_cache_attention of a DSA layer takes the hidden states and the query residual too
    assert "self.kv_cache_attention(q_nope, q_pe, compressed_kv, cos, sin, forward_metadata, hidden_states, " \
           "q_resid)" in text


def test_dsa_standalone_integration_names_the_sparse_call(tmp_path):
    config = saved_config(transformers.AutoConfig.for_model("deepseek_v32"), tmp_path, "deepseek_v32")
    m = analyze(AnalyzeRequest(config=str(config), deploy_mode="standalone"))
    text = render_manifest(m).files["INTEGRATION.md"]
    assert "npu_fused_infer_attention_score" not in text and "npu_sparse_flash_attention" in text
    assert "self.kv_cache_attention(q_nope, q_pe, compressed_kv, cos, sin, meta, hidden_states, q_resid)" in text


def test_fa_models_keep_their_fa_rows():
    """Negative control: an FA model still shows the FA version, layout and its sparse_mode rows."""
    m = analyze(AnalyzeRequest(config=str(CONFIGS / "qwen3_8b.json"), deploy_mode="framework", framework_api="G2"))
    labels = _labels(m)
    assert all(x in labels for x in FA_ROW_LABELS) and any(x.startswith("sparse_mode / mask") for x in labels)
    assert not any(x.startswith("稀疏注意力调用") for x in labels)
    assert "npu_fused_infer_attention_score" in render_manifest(m).files["INTEGRATION.md"]


def test_a_legacy_model_with_its_own_attention_shows_no_fa_rows():
    """gemma2's soft-cap keeps the model's own eager attention: no FA call, so no FA version or band rows."""
    m = analyze(AnalyzeRequest(config=str(CONFIGS / "gemma2_9b.json"), deploy_mode="framework", framework_api="G2"))
    assert m.legacy_attention.kernel == "model"
    labels = _labels(m)
    assert "FA 版本" not in labels and "input_layout" not in labels
    assert not any(x.startswith(("sparse_mode / mask", "pre_tokens / next_tokens")) for x in labels), labels
    assert "cache 布局" in labels and "softmax scale" in labels
    text = decisions_markdown(m)
    assert "| cache 布局 | BSH |" in text


def test_v206_is_named_for_fa_and_sparse_fa():
    from model_infer_kvcache.validators.pipeline.check_ids import CHECKS

    name = next(c.name for c in CHECKS if c.id == "V206")
    assert "FA call" not in name.replace("sparse FA", "")  # not FA's alone
    assert "attention call" in name and "sparse FA" in name
