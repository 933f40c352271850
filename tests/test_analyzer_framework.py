"""--framework-root: API generation detection, registration / runner self-check, deploy-mode priority.

The fake checkouts under tests/fixtures/framework_g{0,1,2} carry cache_info.py dataclasses with the
fields each generation has (references/framework.md, 'API 代际'), a support_models.py and models/<x>/runner_<x>.py files.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.framework_checkout import (
    checkout_fa_version,
    dataclass_fields,
    detect_generation,
    inspect_checkout,
    names_match,
    relative_imports,
    runner_is_standalone,
)

FIX = Path(__file__).parent / "fixtures"
CONFIGS = FIX / "configs"
G0, G1, G2 = (str(FIX / f"framework_g{i}") for i in range(3))


def run(config: str, **kw):
    return analyze(AnalyzeRequest(config=str(CONFIGS / f"{config}.json"), **kw))


# ---------------------------------------------------------------- generation detection


@pytest.mark.parametrize("root, generation, words", [
    (G0, "G0", "model-level block_size, no is_mla_backend"),
    (G1, "G1", "model-level block_size + is_mla_backend"),
    (G2, "G3", "G3 (HEAD era): per-entry block_size plus"),  # the G2 fixture carries the HEAD-era fields
])
def test_generation_from_dataclass_fields(root, generation, words):
    source = (Path(root) / "executor/core/kv_cache/cache_info.py").read_text(encoding="utf-8")
    gen, evidence = detect_generation(source)
    assert gen == generation and words in evidence


def test_fields_read_without_import_including_inherited_ones():
    source = textwrap.dedent("""
        import torch_npu  # would fail to import on CPU: the analyzer only parses
        from dataclasses import dataclass

        @dataclass
        class _Base:
            cache_name: str
            attn_type: str

        @dataclass
        class CacheEntry(_Base):
            dim: int
            block_size: int = 128
            manager_key: str = None

        @dataclass
        class ModelCacheInfo:
            num_layers: int
            layer_infos: list
            is_mla_backend: bool = False
    """)
    assert dataclass_fields(source, "CacheEntry") == ["cache_name", "attn_type", "dim", "block_size", "manager_key"]
    assert detect_generation(source)[0] == "G2"
    assert dataclass_fields(source, "Missing") is None
    assert detect_generation("class CacheEntry:\n    x: int\n")[0] is None
    unknown = "class CacheEntry:\n    x: int\nclass ModelCacheInfo:\n    y: int\n"
    gen, why = detect_generation(unknown)
    assert gen is None and "unrecognised" in why


def test_checkout_facts_g0_registered_framework_runner():
    c = inspect_checkout(G0, "qwen3", "qwen3", ["Qwen3ForCausalLM"])
    assert c.generation == "G0"
    assert c.registered and "class Qwen3ForCausalLM" in c.registered_evidence
    by_key = inspect_checkout(G0, "qwen3", "qwen3")  # no architectures: the key "qwen3_8b" names it
    assert by_key.registered and "'qwen3_8b'" in by_key.registered_evidence
    assert not inspect_checkout(G0, "mistral", "mistral", ["MistralForCausalLM"]).registered
    assert c.runner_files == ["models/qwen3_8b/runner_qwen3_8b.py"]
    assert not c.standalone_runner and "derives from a framework base" in c.runner_evidence


def test_checkout_facts_registration_by_class_name():
    # DeepSeek-V3 sits under the key "deepseek_r1": its class DeepseekV3ForCausalLM is the evidence.
    c = inspect_checkout(G1, "deepseek_v3", "deepseek_v3", ["DeepseekV3ForCausalLM"])
    assert c.generation == "G1" and c.registered
    assert "DeepseekV3ForCausalLM" in c.registered_evidence


def test_checkout_facts_standalone_runner():
    c = inspect_checkout(G1, "llama", "llama", ["LlamaForCausalLM"])
    assert not c.registered
    assert c.standalone_runner and c.runner_files == ["models/llama/runner_llama.py"]
    assert "own loop" in c.runner_evidence


def test_checkout_g2_support_models_under_entrypoints_and_attribute_base():
    c = inspect_checkout(G2, "qwen3_moe", "qwen3", ["Qwen3MoeForCausalLM"])
    assert c.generation == "G3" and c.registered  # cache_layout/compress_ratio/allocator: HEAD era
    assert c.registered_evidence.startswith("executor/core/entrypoints/support_models.py")
    assert c.runner_files == ["models/qwen3_moe/runner_qwen3_moe.py"]
    assert not c.standalone_runner  # derives from executor.model_runner.ModelRunner


def test_names_match_whole_tokens():
    assert names_match("qwen3_moe", "qwen3-moe")
    assert names_match("qwen3", "qwen3_8b")
    assert names_match("gpt_oss", "gpt-oss")
    assert not names_match("llama", "llama4")
    assert not names_match("llama4_text", "llama")
    assert not names_match("qwen2", "qwen25_7b_instruct")
    assert not names_match("", "anything")


@pytest.mark.parametrize("source, standalone, words", [
    ("class MyRunner:\n    def run(self):\n        while True:\n            self.model.decode()\n", True, "own loop"),
    ("class MyRunner:\n    def run(self, xs):\n        for x in xs:\n            self.model.forward(x)\n", True, "own loop"),
    ("class MyRunner:\n    def run(self):\n        return 1\n", False, "inconclusive"),
    ("from executor.model_runner import ModelRunner as Base\nclass MyRunner(Base):\n"
     "    def run(self):\n        while True:\n            pass\n", False, "derives from a framework base"),
    ("def helper():\n    pass\n", False, "no runner class"),
    ("class R(:\n", False, "unparsable"),
])
def test_runner_self_check(source, standalone, words):
    got, why = runner_is_standalone(source)
    assert got == standalone and words in why


# ---------------------------------------------------------------- bad roots


def test_relative_imports_name_the_sibling_files():
    source = textwrap.dedent("""\
        import torch
        from module.linear import RowParallel  # absolute: another package of the checkout, not the model's
        from . import kvcache_attention
        from .kvcache_attention import KVCacheAttentionMixin
        from ..utils.helpers import pad
        from .. import common
    """)
    assert relative_imports(source, "models/m/models/modeling_m.py") == [
        "models/m/models/kvcache_attention.py", "models/m/utils/helpers.py", "models/m/common.py"]


def test_fa_version_read_from_the_file_a_migrated_model_imports(tmp_path):
    """A migrated model calls FA only from the rendered file beside it; a file it does not import does not count."""
    folder = tmp_path / "models" / "m" / "models"
    folder.mkdir(parents=True)
    (folder / "kvcache_attention.py").write_text("import torch_npu\n\n\ndef attend(q, k, v):\n"
                                                 "    return torch_npu.npu_fused_infer_attention_score_v2(q, k, v)\n")
    (folder / "stale_copy.py").write_text("import torch_npu\n\n\ndef attend(q, k, v):\n"
                                          "    return torch_npu.npu_fused_infer_attention_score(q, k, v)\n")
    model = folder / "modeling_m.py"
    model.write_text("from .kvcache_attention import attend\n")
    assert checkout_fa_version(tmp_path, ["models/m/models/modeling_m.py"]) == (
        "v2", "the checkout's model already calls FA v2: models/m/models/kvcache_attention.py:5 "
              "(npu_fused_infer_attention_score_v2)")
    model.write_text("import torch\n")  # imports nothing of its own: no FA call found
    assert checkout_fa_version(tmp_path, ["models/m/models/modeling_m.py"])[0] is None


def test_bad_framework_roots(tmp_path):
    with pytest.raises(InputError) as err:
        inspect_checkout(tmp_path / "missing", "qwen3", "qwen3")
    assert err.value.field == "--framework-root" and "not a directory" in err.value.message
    with pytest.raises(InputError) as err:
        inspect_checkout(tmp_path, "qwen3", "qwen3")
    assert err.value.where.endswith("executor/core/kv_cache/cache_info.py")
    info = tmp_path / "executor/core/kv_cache/cache_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("class CacheEntry(:\n", encoding="utf-8")
    with pytest.raises(InputError) as err:
        inspect_checkout(tmp_path, "qwen3", "qwen3")
    assert "cannot parse" in err.value.message and err.value.where == str(info)


# ---------------------------------------------------------------- deploy-mode priority end to end


def test_self_check_registration_beats_default_and_sets_the_generation():
    m = run("qwen3_8b", framework_root=G0)
    assert (m.deploy_mode.value, m.deploy_mode.source) == ("framework", "self_check")
    assert "support_models" in m.deploy_mode.evidence[0]
    assert m.framework_api == "G0" and "cache_info.py" in m.framework_api_evidence
    assert m.inputs.framework_root == G0
    assert m.inputs.runner_files == ["models/qwen3_8b/runner_qwen3_8b.py"]
    assert not any("generation unknown" in q.message for q in m.open_questions)


def test_self_check_standalone_runner_means_no_framework_api():
    m = run("llama31_8b", framework_root=G1)
    assert (m.deploy_mode.value, m.deploy_mode.source) == ("standalone", "self_check")
    assert m.framework_api is None and "standalone" in m.framework_api_evidence


def test_registration_outranks_a_standalone_runner_and_the_loser_is_recorded():
    m = run("llama31_8b", framework_root=G2)
    assert (m.deploy_mode.value, m.deploy_mode.source) == ("framework", "self_check")
    assert [(e.value, e.source) for e in m.deploy_mode.overridden] == [("standalone", "self_check")]
    assert "own runner loop" in m.deploy_mode.overridden[0].detail
    assert any("overridden by framework" in w.message for w in m.warnings)
    assert m.framework_api == "G3"  # the framework_g2 fixture carries the HEAD-era fields (renders: the G2 contract)


def test_user_flag_beats_self_check():
    m = run("qwen3_8b", framework_root=G0, deploy_mode="standalone")
    assert (m.deploy_mode.value, m.deploy_mode.source) == ("standalone", "user")
    assert [(e.value, e.source) for e in m.deploy_mode.overridden] == [("framework", "self_check")]
    assert any("from self_check" in w.message and "overridden by standalone" in w.message for w in m.warnings)


def test_dispatch_beats_user_and_self_check():
    m = run("qwen3_8b", framework_root=G0, deploy_mode="framework", dispatch="部署模式：独立部署")
    assert (m.deploy_mode.value, m.deploy_mode.source) == ("standalone", "dispatch")
    assert m.deploy_mode.evidence == ["dispatch line '部署模式：独立部署'"]
    assert [(e.value, e.source) for e in m.deploy_mode.overridden] == [("framework", "user"),
                                                                        ("framework", "self_check")]
    assert m.inputs.dispatch == "部署模式：独立部署"


def test_agreeing_sources_are_recorded_without_warnings():
    m = run("qwen3_8b", framework_root=G0, dispatch="部署模式: 框架部署",
            progress=str(FIX / "progress" / "qwen3_framework.md"))
    assert (m.deploy_mode.value, m.deploy_mode.source) == ("framework", "dispatch")
    assert [e.source for e in m.deploy_mode.overridden] == ["self_check", "self_check"]
    assert not any("overridden" in w.message for w in m.warnings)


def test_progress_wording_is_self_check_evidence():
    m = run("llama31_8b", progress=str(FIX / "progress" / "llama_standalone.md"))
    assert (m.deploy_mode.value, m.deploy_mode.source) == ("standalone", "self_check")
    assert "llama_standalone.md:8" in m.deploy_mode.evidence[0]


def test_default_is_framework_and_says_so():
    m = run("qwen3_8b")
    assert (m.deploy_mode.value, m.deploy_mode.source) == ("framework", "default")
    assert m.framework_api is None
    assert any("generation unknown" in q.message for q in m.open_questions)


def test_framework_api_flag_must_agree_with_the_checkout():
    assert run("qwen3_8b", framework_api="G1").framework_api == "G1"
    assert run("qwen3_8b", framework_root=G1, framework_api="G1").framework_api == "G1"
    with pytest.raises(InputError) as err:
        run("qwen3_8b", framework_root=G0, framework_api="G2")
    assert err.value.where == "--framework-api" and "G0" in err.value.message


# ---------------------------------------------------------------- the pinned public commits

from shared_dirs import upstream_head, upstream_history  # noqa: E402


def _pinned(commit):
    return upstream_head() if commit == "HEAD" else upstream_history(commit)


@pytest.mark.parametrize("commit, generation", [
    ("f0b0fde", "G0"), ("2c2336a", "G1"), ("48a59dc", "G2"), ("HEAD", "G3"),
])
def test_generation_of_each_pinned_commit(commit, generation):
    root = _pinned(commit)
    gen, evidence = detect_generation((root / "executor/core/kv_cache/cache_info.py").read_text(encoding="utf-8"))
    assert gen == generation
    if generation == "G3":
        assert "cache_layout" in evidence and "MambaCacheEntry" in evidence


@pytest.mark.parametrize("commit, model_type, architectures, registered, key_words, absent", [
    # The old registry holds only qwen3-moe: dense Qwen3 is not registered through it.
    ("2c2336a", "qwen3", ["Qwen3ForCausalLM"], False, "no key of its own", None),
    ("2c2336a", "qwen3_moe", ["Qwen3MoeForCausalLM"], True, "'qwen3-moe'", None),
    ("f0b0fde", "deepseek_v3", ["DeepseekV3ForCausalLM"], True, "'deepseek_r1'", None),
    # HEAD's lazy registry names classes as strings; the key pairs them with the config class.
    ("HEAD", "qwen3", ["Qwen3ForCausalLM"], True, "'qwen3_8b'", "'qwen3_moe'"),
    ("HEAD", "qwen2", ["Qwen2ForCausalLM"], True, "'qwen25_7b_instruct'", "'qwen3_8b'"),
    ("HEAD", "deepseek_v3", ["DeepseekV3ForCausalLM"], True, "'deepseek_r1'", "'deepseek_v3_2_exp'"),
    ("HEAD", "gpt_oss", ["GptOssForCausalLM"], True, "'gpt_oss'", None),
    ("HEAD", "llama", ["LlamaForCausalLM"], False, "no key of its own", None),
])
def test_registration_on_pinned_registries(commit, model_type, architectures, registered, key_words, absent):
    facts = inspect_checkout(_pinned(commit), model_type, model_type, architectures)
    assert facts.registered is registered, facts.registered_evidence
    assert key_words in facts.registered_evidence
    if absent:
        assert absent not in facts.registered_evidence


def test_registry_read_like_the_checkout():
    lazy = 'import importlib\n_specs = {"a_b": [("models.a.m", "AForCausalLM"), ("models.a.c", "AConfig")]}\n'
    eager = "from m import X, XConfig\nmodel_dict = {'x-1': (X, XConfig), 'y': m.Y}\n"
    from model_infer_kvcache.analyzer.framework_checkout import read_registry
    assert read_registry(lazy) == {"a_b": ["AForCausalLM", "AConfig"]}
    assert read_registry(eager) == {"x-1": ["X", "XConfig"], "y": ["Y"]}


def test_names_match_rejects_sibling_models():
    assert not names_match("qwen3", "qwen3-moe")
    assert not names_match("deepseek_v3", "deepseek_v3_2_exp")
    assert names_match("qwen3_moe", "qwen3_moe_pd")
    assert names_match("qwen3", "qwen3_8b")


@pytest.mark.parametrize("commit, mamba", [("HEAD", True), ("48a59dc", False)])
def test_hybrid_recurrent_model_needs_a_mamba_capable_checkout_in_framework_mode(commit, mamba):
    """The linear layers' states register as MambaCacheEntry (fda5670+): HEAD pages with Mamba state layers, a
    checkout without it is a blocker naming the checkout (Legacy), and standalone mode needs neither."""
    m = run("qwen3_next", framework_root=str(_pinned(commit)), deploy_mode="framework")
    assert sum(layer.is_state for layer in m.layers) == 36
    blocked = [b for b in m.blockers if "MambaCacheEntry" in b.message]
    if mamba:
        assert m.kv_mode.value == "paged" and not m.blockers
    else:
        assert m.kv_mode.value == "legacy" and len(blocked) == 1 and "--framework-root" in blocked[0].fields
        assert "48a59dc" not in blocked[0].message and "standalone" in blocked[0].message
    standalone = run("qwen3_next", framework_root=str(_pinned(commit)), deploy_mode="standalone")
    assert standalone.kv_mode.value == "paged" and not standalone.blockers


def test_no_recurrent_note_for_models_without_linear_layers():
    m = run("qwen3_8b", framework_root=str(_pinned("HEAD")), deploy_mode="framework")
    assert not any("MambaCacheEntry" in f.message for f in m.warnings + m.open_questions + m.blockers)
    assert m.linear_attention is None and not any(layer.states for layer in m.layers)


# ---------------------------------------------------------------- choices the checkout's model already made


def _checkout_with_model(tmp_path: Path, body: str, eager: bool = True) -> Path:
    """A G2 fixture copy whose registry loads models/qwen3_moe/modeling_qwen3_moe.py holding ``body``."""
    import shutil

    root = tmp_path / "checkout"
    shutil.copytree(G2, root)
    model = root / "models" / "qwen3_moe" / "modeling_qwen3_moe.py"
    model.write_text(textwrap.dedent(body), encoding="utf-8")
    if not eager:  # the lazy registry form of HEAD: ("module", "Class") pairs
        (root / "executor/core/entrypoints/support_models.py").write_text(
            '_specs = {"qwen3_moe": [("models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeForCausalLM"),\n'
            '                        ("models.qwen3_moe.configuration_qwen3_moe", "Qwen3MoeConfig")]}\n',
            encoding="utf-8")
    return root


V1_CALL = """
    import torch
    class Qwen3MoeAttention:
        def forward(self, q, k, v):
            out, _ = torch.ops.npu.npu_fused_infer_attention_score(q, k, v, num_heads=4)
            return out
"""
V2_CALL = V1_CALL.replace("npu_fused_infer_attention_score(", "npu_fused_infer_attention_score_v2(")


@pytest.mark.parametrize("eager", [True, False])
def test_fa_version_is_read_from_the_checkouts_model_file(tmp_path, eager):
    root = _checkout_with_model(tmp_path, V2_CALL, eager)
    c = inspect_checkout(root, "qwen3_moe", "qwen3", ["Qwen3MoeForCausalLM"])
    assert c.model_files == ["models/qwen3_moe/modeling_qwen3_moe.py"]
    assert (c.fa_version, c.fa_evidence) == (
        "v2", "the checkout's model already calls FA v2: models/qwen3_moe/modeling_qwen3_moe.py:5 "
              "(npu_fused_infer_attention_score_v2)")
    m = run("qwen3_30b_a3b", framework_root=str(root))
    assert m.fa.version == "v2" and m.fa.is_default  # a preference read from the file, not a requirement
    assert "models/qwen3_moe/modeling_qwen3_moe.py:5" in m.fa.reason and "--framework-root" in m.fa.reason
    # the same checkout with a v1 call: v1, the family default, but now read from the file
    root_v1 = _checkout_with_model(tmp_path / "v1", V1_CALL, eager)
    m1 = run("qwen3_30b_a3b", framework_root=str(root_v1))
    assert m1.fa.version == "v1" and "already calls FA v1: models/qwen3_moe/modeling_qwen3_moe.py:5" in m1.fa.reason


def test_fa_version_the_checkout_does_not_settle_keeps_the_default_and_says_why(tmp_path):
    both = V2_CALL + "            torch.ops.npu.npu_fused_infer_attention_score(q, k, v)\n"
    m = run("qwen3_30b_a3b", framework_root=str(_checkout_with_model(tmp_path, both)))
    assert m.fa.version == "v1" and m.fa.is_default and "GQA/MHA default v1" in m.fa.reason
    assert "did not settle it (the checkout's model calls both versions: v1 at" in m.fa.reason
    # the user's flag and the sinks rule still win over the file
    root = _checkout_with_model(tmp_path / "flag", V2_CALL)
    assert run("qwen3_30b_a3b", framework_root=str(root), fa_version="v1").fa.version == "v1"
    # no model file registered (a model being migrated): the default, no checkout words
    plain = run("qwen3_30b_a3b", framework_root=G2)
    assert plain.fa.version == "v1" and plain.fa.is_default and "framework-root" not in plain.fa.reason


def test_upstream_qwen_manifest_from_the_checkout_lints_the_upstream_file_clean():
    """Issue 26: the upstream qwen file calls FA v2; a manifest defaulted to v1 made lint report KV803 on the
    unmodified file. With --framework-root the analyzer reads v2 from that file."""
    from model_infer_kvcache.validators.lint import lint_paths
    from shared_dirs import upstream_head

    root = upstream_head()
    m = run("qwen3_8b", framework_root=str(root))
    assert m.fa.version == "v2" and "models/qwen/models/modeling_qwen.py:" in m.fa.reason
    model_file = root / "models" / "qwen" / "models" / "modeling_qwen.py"
    assert [f.rule for f in lint_paths([model_file], manifest=m).findings if f.rule == "KV803"] == []
    defaulted = run("qwen3_8b", framework_api="G2")
    assert defaulted.fa.version == "v1"  # negative control: the default manifest does report the mismatch
    assert "KV803" in [f.rule for f in lint_paths([model_file], manifest=defaulted).findings]


def test_a_head_checkout_is_named_g3_by_analyze_and_by_the_harness():
    """One name per generation: analyze's manifest and validate's harness both call HEAD G3 (its renders follow
    the G2 model-side contract, which the evidence says)."""
    from model_infer_kvcache.validators.harness.install import install_framework
    from model_infer_kvcache.validators.standins import device_standins
    from model_infer_kvcache.validators.standins.third_party import absent_third_party
    from shared_dirs import upstream_head

    m = run("qwen3_8b", framework_root=str(upstream_head()))
    assert m.framework_api == "G3"
    assert "cache_info.py: G3 (HEAD era)" in m.framework_api_evidence and "G2 contract" in m.framework_api_evidence
    assert "HEAD-era G2" not in m.framework_api_evidence
    with device_standins(), absent_third_party(), install_framework(framework_root=upstream_head()) as fw:
        assert fw.real and fw.generation == "G3"
