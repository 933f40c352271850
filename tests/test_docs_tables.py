"""Doc-vs-code checks: the tables in SKILL.md / references/ equal what the code implements.

Each check runs on the committed docs (must be clean) and on an edited copy or against a changed
rule (must report the drift): a rule that changes without its table fails the suite.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.manifest import MaskPerPath, PerPath
from model_infer_kvcache.validators.docgen import doc_tables as dt

ROOT = dt.ROOT


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    """A copy of the docs (SKILL.md, references/) to edit."""
    shutil.copy(ROOT / "SKILL.md", tmp_path / "SKILL.md")
    shutil.copytree(ROOT / "references", tmp_path / "references")
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) >= 1, f"{old!r} not in {path.name}"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def _drift(problems: list[str], rel: str, block: str) -> bool:
    return any(p.startswith(f"{rel}: block {block!r} differs") for p in problems)


# --------------------------------------------------------------------------- generated blocks


def test_committed_generated_tables_equal_the_code():
    problems = dt.check_generated(ROOT)
    assert not problems, "\n".join(problems) + "\n(regenerate: python -m model_infer_kvcache.validators.docgen.doc_tables --write)"


def test_every_required_block_is_present_where_the_agents_read_it():
    for rel, names in dt.REQUIRED_BLOCKS.items():
        found = [name for name, _ in dt.blocks((ROOT / rel).read_text(encoding="utf-8"))]
        assert set(names) <= set(found), (rel, names, found)


@pytest.mark.parametrize(("rel", "block", "old", "new"), [
    ("SKILL.md", "fa-args", "| `num_heads` | `num_query_heads` |", "| `num_heads` | `num_heads` |"),
    ("SKILL.md", "model-kinds", "| v2 | TND_NTD | 是 |", "| v1 | TND_NTD | 是 |"),
    ("SKILL.md", "sparse-paths", "| MLA absorb,Paged TND_NTD | 3 / causal_2048 | 0 / none |",
     "| MLA absorb,Paged TND_NTD | 3 / causal_2048 | 3 / causal_2048 |"),
    ("references/fa_operators.md", "sparse-paths", "W-1 / 0(exclusive)", "W / 0(exclusive)"),
    ("references/framework.md", "framework-generations", "| G1 |", "| G2 |"),
    ("references/errors.md", "lint-rules", "[KV203](#kv203)", "[KV299](#kv299)"),
])
def test_a_hand_edited_cell_is_reported(docs_copy: Path, rel: str, block: str, old: str, new: str):
    assert dt.check_generated(docs_copy) == []
    _edit(docs_copy / rel, old, new)
    problems = dt.check_generated(docs_copy)
    assert _drift(problems, rel, block), problems
    assert len(problems) == 1, problems  # only the edited block


def test_write_generated_restores_an_edited_copy(docs_copy: Path):
    _edit(docs_copy / "SKILL.md", "| `scale` | `softmax_scale` |", "| `scale` | `scale` |")
    assert dt.write_generated(docs_copy) == [docs_copy / "SKILL.md"]
    assert dt.check_generated(docs_copy) == []
    assert (docs_copy / "SKILL.md").read_text(encoding="utf-8") == (ROOT / "SKILL.md").read_text(encoding="utf-8")


def test_a_removed_or_unknown_block_is_reported(docs_copy: Path):
    text = (docs_copy / "SKILL.md").read_text(encoding="utf-8")
    text = text.replace("kvcache:generated fa-args", "kvcache:generated fa-argz")
    (docs_copy / "SKILL.md").write_text(text, encoding="utf-8")
    problems = dt.check_generated(docs_copy)
    assert "SKILL.md: missing generated block 'fa-args'" in problems
    assert "SKILL.md: unknown generated block 'fa-argz'" in problems


def test_sparse_rule_change_without_its_table_is_reported(monkeypatch):
    """MLA absorb decode switched to mode 3 in the analyzer, tables untouched: both tables drift."""
    import model_infer_kvcache.analyzer.rules as rules
    original = rules.decide_sparse

    def changed(attn_type, is_mla, kv_mode):
        if is_mla:
            return (PerPath(prefill=3, decode=3), MaskPerPath(prefill="causal_2048", decode="causal_2048"), "x")
        return original(attn_type, is_mla, kv_mode)

    monkeypatch.setattr(rules, "decide_sparse", changed)
    problems = dt.check_generated(ROOT)
    assert _drift(problems, "SKILL.md", "sparse-paths")
    assert _drift(problems, "references/fa_operators.md", "sparse-paths")


def test_window_rule_change_without_its_table_is_reported(monkeypatch):
    """pre_tokens = W under the default reading (the upstream value): the band column drifts."""
    import model_infer_kvcache.analyzer.rules as rules
    original = rules.decide_window_tokens

    def upstream(window, reading="exclusive"):
        pre, nxt, why = original(window, "inclusive")
        return pre, nxt, why

    monkeypatch.setattr(rules, "decide_window_tokens", upstream)
    assert _drift(dt.check_generated(ROOT), "SKILL.md", "sparse-paths")


def test_fa_version_rule_change_without_its_table_is_reported(monkeypatch):
    import model_infer_kvcache.analyzer.rules as rules
    from model_infer_kvcache.analyzer.rules import Decision

    monkeypatch.setattr(rules, "decide_fa_version", lambda facts, *args, **kwargs: Decision("v1", "changed"))
    problems = dt.check_generated(ROOT)
    assert _drift(problems, "SKILL.md", "model-kinds")


def test_blocker_rule_change_without_its_table_is_reported(monkeypatch):
    """Soft-capping no longer blocks Paged: the Gemma-2 row of the selection table drifts."""
    import model_infer_kvcache.analyzer.rules as rules
    original = rules.find_blockers
    monkeypatch.setattr(rules, "find_blockers",
                        lambda facts, *args: [b for b in original(facts, *args) if "soft-capping" not in b.message])
    assert _drift(dt.check_generated(ROOT), "SKILL.md", "model-kinds")


def test_fa_keyword_rename_without_its_table_is_reported(monkeypatch):
    import dataclasses

    from model_infer_kvcache.analyzer.operators import fa_facts

    renamed = dataclasses.replace(fa_facts.FA_KEYWORDS["v2"], scale="scale")
    monkeypatch.setitem(fa_facts.FA_KEYWORDS, "v2", renamed)
    with pytest.raises(KeyError):
        # `scale` is not an argument of the v2 schema: the generator refuses a name the op lacks
        dt.fa_args_table()
    renamed = dataclasses.replace(fa_facts.FA_KEYWORDS["v2"], kv_lens="actual_seq_lengths_kv")
    monkeypatch.setitem(fa_facts.FA_KEYWORDS, "v2", renamed)
    monkeypatch.setattr(dt, "default_text", lambda op, name: "None")
    problems = dt.check_generated(ROOT)
    assert _drift(problems, "SKILL.md", "fa-args")
    assert _drift(problems, "references/fa_operators.md", "fa-args")


def test_generation_change_without_its_table_is_reported(monkeypatch):
    import model_infer_kvcache.validators.harness.generations as gens
    original = gens.get_generation

    def g1_keys_by_group(name):
        ns = original(name)
        if ns.name == "G1":
            ns.table_key = "group_key"
        return ns

    monkeypatch.setattr(gens, "get_generation", g1_keys_by_group)
    assert _drift(dt.check_generated(ROOT), "references/framework.md", "framework-generations")


def test_every_fa_name_in_the_table_is_accepted_by_its_real_schema():
    from dataclasses import fields

    from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS
    from model_infer_kvcache.analyzer.operators.schemas import accepted_keywords

    for version, args in FA_KEYWORDS.items():
        accepted = accepted_keywords(args.op)
        for f in fields(args)[1:]:
            assert getattr(args, f.name) in accepted, (version, f.name)


def test_model_kind_table_agrees_with_real_configs():
    """The synthetic kinds stand for real models: the analyzer decides the same for the real configs."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze

    configs = ROOT / "tests" / "fixtures" / "configs"
    pairs = {"gqa": "qwen3_8b", "sliding": "mistral_7b_v01", "mixed_sinks": "gpt_oss_20b", "mixed": "gemma3_4b",
             "mla": "deepseek_v3", "softcap": "gemma2_9b", "chunked": "llama4_scout", "linear": "qwen3_next",
             "per_layer_shape": "gemma4_26b_a4b"}

    def summary(m):
        return (m.kv_mode.value, sorted({layer.attn_type for layer in m.layers}), m.fa.version, m.fa.input_layout,
                m.mla.absorb, m.mixed_attn_types, m.attention_layers[0].write_op)

    for kind, config in pairs.items():
        real = analyze(AnalyzeRequest(config=str(configs / f"{config}.json"), framework_api="G2"))
        assert summary(real) == summary(dt.kind_manifest(kind)), (kind, config)


# --------------------------------------------------------------------------- manifest fields


def test_manifest_doc_documents_every_schema_field():
    assert dt.check_manifest_doc(ROOT) == []
    schema = json.loads((ROOT / "references" / "manifest.schema.json").read_text(encoding="utf-8"))
    assert len(dt.manifest_fields(schema)) >= 140


def test_committed_schema_is_what_kvcache_schema_prints():
    from model_infer_kvcache.analyzer.manifest import manifest_json_schema

    committed = json.loads((ROOT / "references" / "manifest.schema.json").read_text(encoding="utf-8"))
    assert committed == manifest_json_schema()


def test_manifest_doc_drift_is_reported(docs_copy: Path):
    schema_path = docs_copy / "references" / "manifest.schema.json"
    schema = json.loads(schema_path.read_text(encoding="utf-8"))
    schema["$defs"]["ParallelPlan"]["properties"]["cp_size"] = {"type": "integer"}
    schema["$defs"]["ParallelPlan"]["required"].append("cp_size")
    schema_path.write_text(json.dumps(schema), encoding="utf-8")
    doc = docs_copy / "references" / "manifest.md"
    _edit(doc, "| `block_size` | `integer` | 是 |", "| `block_size` | `number` | 是 |")
    _edit(doc, "| `mtp.reason` | `string` | 是 | 理由 |\n", "")
    _edit(doc, "| `mixed_attn_types` | `boolean` | 是 |", "| `mixed_attn_types` | `boolean` | 否 |")
    _edit(doc, "## 决策\n", "## 决策\n\n| `kv_mode.legacy_reason` | `string` | 否 | 虚构 |\n")
    problems = dt.check_manifest_doc(docs_copy)
    assert "references/manifest.md: field `parallel.cp_size` is not documented" in problems
    assert "references/manifest.md: field `mtp.reason` is not documented" in problems
    assert any("`block_size` type 'number'" in p for p in problems)
    assert any("`mixed_attn_types` required '否'" in p for p in problems)
    assert "references/manifest.md: `kv_mode.legacy_reason` is not a manifest field" in problems
    assert len(problems) == 5, problems


# --------------------------------------------------------------------------- validation checks


def test_validation_doc_lists_exactly_the_registered_checks():
    assert dt.check_validation_doc(ROOT) == []
    assert len(dt.validation_checks()) >= 40


def test_validation_doc_drift_is_reported(docs_copy: Path):
    from model_infer_kvcache.validators.pipeline.check_ids import CHECKS, CheckDef

    checks = (*CHECKS, CheckDef("V499", "release", "<N> blocks reused after free"))
    doc = docs_copy / "references" / "validation.md"
    _edit(doc, "| V103 | init | `is_mla_backend` |", "| V103 | init | `is_mla_backend_set` |")
    _edit(doc, "| V209 | runtime |", "| V290 | runtime |")
    problems = dt.check_validation_doc(docs_copy, checks)
    assert "references/validation.md: check V499 [release] `<N> blocks reused after free` is not documented" in problems
    assert "references/validation.md: check V103 [init] `is_mla_backend` is not documented" in problems
    assert "references/validation.md: documents V103 [init] `is_mla_backend_set`, which is not registered" in problems
    assert any(p.startswith("references/validation.md: documents V290 [runtime]") for p in problems)
    assert len(problems) == 5, problems


# --------------------------------------------------------------------------- rule IDs


def test_rule_book_has_a_section_per_rule_and_skill_names_only_real_rules():
    from model_infer_kvcache.validators.lint.registry import RULES

    assert dt.check_rule_book(ROOT) == []
    named = dt.skill_error_table_ids((ROOT / "SKILL.md").read_text(encoding="utf-8"))
    assert len(set(named)) >= 12 and set(named) <= set(RULES)


def test_new_rule_without_a_rule_book_entry_is_reported(monkeypatch):
    from model_infer_kvcache.validators.lint.registry import RULES, Rule

    monkeypatch.setitem(RULES, "KV901", Rule("KV901", "new-rule", "a new rule", "m", "h"))
    problems = dt.check_rule_book(ROOT)
    assert problems == ["references/errors.md: no section for rule KV901"]
    assert _drift(dt.check_generated(ROOT), "references/errors.md", "lint-rules")


def test_unknown_rule_id_in_skill_error_table_is_reported(docs_copy: Path):
    _edit(docs_copy / "SKILL.md", "| KV401 |", "| KV499 |")
    problems = dt.check_rule_book(docs_copy)
    assert "SKILL.md: error table names unknown rule KV499" in problems
    assert "SKILL.md: names unknown rule KV499" in problems
