"""Unit tests of what lets a checkout written for transformers 4.x and the device run on CPU under
transformers 5 (issue 23): feature probes on the stand-ins, the removed mask helpers, the checkout config
class as the authority on its config.json, per-layer fields cut with the layers, and the "not supported by
kvcache" classification of operators. No snapshot needed."""

from __future__ import annotations

import sys

import pytest
from transformers.configuration_utils import PretrainedConfig


def test_feature_probes_answer_like_the_real_module():
    """hasattr is False and getattr(default) gives the default for an operator the emulation lacks (a model's
    own fallback runs); an unguarded use still raises the one-line UnemulatedOperatorError."""
    import torch
    from model_infer_kvcache.validators.npu_ops import UnemulatedOperatorError
    from model_infer_kvcache.validators.standins import device_standins

    with device_standins():
        import torch_npu

        assert hasattr(torch_npu, "npu_rms_norm")  # emulated: present
        assert not hasattr(torch_npu, "npu_fused_causal_conv1d_v2")
        assert getattr(torch_npu, "npu_fused_causal_conv1d_v2", "fallback") == "fallback"
        assert not hasattr(torch.ops.npu, "npu_fused_causal_conv1d_v2")
        assert not hasattr(torch.npu, "no_such_call")
        with pytest.raises(UnemulatedOperatorError, match=r"torch_npu\.npu_fused_causal_conv1d_v2 is not emulated"):
            torch_npu.npu_fused_causal_conv1d_v2  # noqa: B018


def test_removed_transformers_mask_helpers_import_and_refuse_when_used(monkeypatch):
    """Where the installed transformers lacks the 4.x mask module (5.x before 5.25), the stand-in serves the
    checkout's imports; 5.25 ships it again as a deprecation shim, so the same check runs with the module hidden."""
    import importlib.util

    from model_infer_kvcache.validators.standins import third_party

    name = "transformers.modeling_attn_mask_utils"
    if importlib.util.find_spec(name) is not None:  # shipped: hide it, as an installed 5.x before 5.25 would
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(third_party.importlib.util, "find_spec",
                            lambda n, *a: None if n == name else real_find_spec(n, *a))
        monkeypatch.delitem(sys.modules, name, raising=False)
    with third_party.absent_third_party() as described:
        from transformers.modeling_attn_mask_utils import (
            AttentionMaskConverter,
            _prepare_4d_attention_mask,
            _prepare_4d_causal_attention_mask,
        )

        class Sub(AttentionMaskConverter):  # a checkout may subclass it at import
            pass

        for fn in (_prepare_4d_attention_mask, _prepare_4d_causal_attention_mask, AttentionMaskConverter,
                   AttentionMaskConverter._unmask_unattended):
            with pytest.raises(RuntimeError, match="not available in this validation run"):
                fn()
        assert any("AttentionMaskConverter" in d for d in described)


class _Legacy(PretrainedConfig):
    """A 4.x-style checkout config class (the shape of LongCat-Flash's and Kimi's): rope_theta taken, a
    read-only num_hidden_layers alias, rope_scaling read."""

    model_type = "kvcache_test_legacy"

    def __init__(self, num_layers=61, rope_theta=10000.0, global_head_dim=512, rope_scaling=None, **kwargs):
        self.num_layers = num_layers
        self.rope_theta = rope_theta
        self.global_head_dim = global_head_dim
        self.rope_scaling = rope_scaling
        super().__init__(**kwargs)

    @property
    def num_hidden_layers(self):
        return self.num_layers

    @property
    def computed(self):
        return 2 * self.num_layers


def test_checkout_config_class_decides_what_its_config_json_holds():
    from model_infer_kvcache.validators.checkout_run.compat import fit_to_config_class, set_config_field

    written = {"num_hidden_layers": 2, "computed": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7},
               "per_layer_config": {"05": {"head_dim": 384}}, "head_dim": 128}
    fitted, notes = fit_to_config_class(written, _Legacy)
    assert fitted["num_layers"] == 2 and "num_hidden_layers" not in fitted  # the alias's field
    assert "computed" not in fitted  # computed, not an alias: dropped
    assert fitted["rope_theta"] == 1e7  # 4.x top-level field from rope_parameters
    assert fitted["global_head_dim"] == 384 and "per_layer_config" not in fitted
    assert len(notes) == 4
    config = _Legacy(**fitted)
    assert (config.num_hidden_layers, config.rope_theta, config.global_head_dim) == (2, 1e7, 384)
    # the file's own field wins over the alias
    assert fit_to_config_class({"num_hidden_layers": 4, "num_layers": 2}, _Legacy)[0] == {"num_layers": 2}
    set_config_field(config, "num_hidden_layers", 61)
    assert config.num_layers == 61
    with pytest.raises(AttributeError):
        set_config_field(config, "computed", 1)
    # negative control: transformers' own classes are left alone
    from transformers import Qwen3Config

    assert fit_to_config_class({"num_hidden_layers": 2}, Qwen3Config) == ({"num_hidden_layers": 2}, [])


class _QwenBase(PretrainedConfig):
    """Upstream qwen's configuration_qwen.py shape: the base takes rope_theta (default 1e6), the registered
    subclass takes only its own fields and passes **kwargs on."""

    model_type = "kvcache_test_qwen_base"

    def __init__(self, rope_theta=1000000.0, **kwargs):
        self.rope_theta = rope_theta
        super().__init__(**kwargs)


class _Qwen3(_QwenBase):
    model_type = "kvcache_test_qwen3"

    def __init__(self, head_dim=128, **kwargs):
        super().__init__(head_dim=head_dim, **kwargs)


def test_rope_theta_reaches_a_base_class_behind_kwargs():
    """A transformers-5 config.json (Qwen3Config() defaults: rope_theta only inside rope_parameters) read by a
    subclass whose own __init__ takes **kwargs: the base's rope_theta must come from the file, or the checkout runs
    at its default 1e6 against transformers' 1e4 (found by `validate --all`: qwen3_8b failed at its cache write)."""
    from model_infer_kvcache.validators.checkout_run.compat import fit_to_config_class

    written = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    fitted, notes = fit_to_config_class(written, _Qwen3)
    assert fitted["rope_theta"] == 10000.0 and _Qwen3(**fitted).rope_theta == 10000.0
    assert notes == ["the checkout's _Qwen3 takes rope_theta (transformers 4.x): written from rope_parameters (10000)"]
    assert _Qwen3(**written).rope_theta == 1e6  # what the checkout read before: its own default


class _Qwen3MoeV4(PretrainedConfig):
    """Upstream qwen3_moe's configuration class shape: it takes transformers 4.x's num_experts."""

    model_type = "kvcache_test_qwen3_moe"

    def __init__(self, num_experts=128, **kwargs):
        self.num_experts = num_experts
        super().__init__(**kwargs)


def test_a_field_transformers_5_renamed_is_written_under_the_name_the_checkout_takes():
    """transformers 5's Qwen3MoeConfig writes num_local_experts (num_experts is an attribute_map alias); a checkout
    class taking num_experts would build 128 experts for a 4-expert checkpoint (found by `validate --all`: the
    loader refused a [4, 128] router weight for a [128, 128] parameter)."""
    from model_infer_kvcache.validators.checkout_run.compat import fit_to_config_class
    from transformers import Qwen3MoeConfig

    written = {**Qwen3MoeConfig().to_dict(), "num_local_experts": 4}
    assert "num_experts" not in written
    fitted, notes = fit_to_config_class(written, _Qwen3MoeV4)
    assert fitted["num_experts"] == 4 and _Qwen3MoeV4(**fitted).num_experts == 4
    assert "the checkout's _Qwen3MoeV4 takes num_experts (transformers 4.x), transformers 5 writes " \
           "num_local_experts: written as num_experts=4" in notes
    assert _Qwen3MoeV4(**written).num_experts == 128  # what the checkout read before

    class _TakesNewName(PretrainedConfig):  # a class taking the new name itself is left alone
        def __init__(self, num_experts=128, num_local_experts=128, **kwargs):
            super().__init__(**kwargs)

    assert "num_experts" not in fit_to_config_class(written, _TakesNewName)[0]


def test_legacy_rope_scaling_reads_none_for_unscaled_rope():
    from model_infer_kvcache.validators.checkout_run.compat import legacy_rope_scaling

    config = _Legacy(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert config.rope_scaling is not None  # transformers 5: an alias of rope_parameters
    with legacy_rope_scaling(_Legacy) as installed:
        assert installed and config.rope_scaling is None
        yarn = _Legacy(max_position_embeddings=131072,
                       rope_parameters={"rope_type": "yarn", "factor": 32.0, "rope_theta": 1e4,
                                        "original_max_position_embeddings": 4096})
        assert yarn.rope_scaling["factor"] == 32.0
    assert config.rope_scaling is not None and "rope_scaling" not in _Legacy.__dict__


def test_per_layer_fields_are_cut_with_the_layers():
    from model_infer_kvcache.validators.pipeline.tiny_model import _trim_per_layer_fields

    d = {"layer_types": ["s"] * 5 + ["f"], "mlp_layer_types": ["dense"] + ["sparse"] * 5,
         "per_layer_config": {"02": {"head_dim": 512}, "5": {"head_dim": 512}}, "eos_token_id": [1] * 6,
         "layers_block_type": ["x"] * 3}
    _trim_per_layer_fields(d, 6, 3)
    assert d["layer_types"] == ["s"] * 3 and d["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert d["per_layer_config"] == {"02": {"head_dim": 512}}
    assert d["eos_token_id"] == [1] * 6  # not a per-layer field
    assert d["layers_block_type"] == ["x"] * 3  # not one entry per real layer: left alone


def test_operators_kvcache_lacks_are_not_supported_and_made_up_ones_are_the_models():
    from model_infer_kvcache.analyzer.operators.schemas import releases_defining
    from model_infer_kvcache.validators.checkout_run.support import unsupported_operator
    from model_infer_kvcache.validators.npu_ops.errors import (
        NpuOpError,
        UnemulatedFeatureError,
        UnemulatedOperatorError,
    )

    assert releases_defining("npu_geglu") == ("2.9.0", "2.14.0")
    assert releases_defining("npu_fused_causal_conv1d_v2") == ("2.14.0",)
    lacking = unsupported_operator(UnemulatedOperatorError("torch_npu.npu_fused_causal_conv1d_v2", "m.py:3"), "m.py:3")
    assert lacking.render() == ("m.py:3: torch_npu.npu_fused_causal_conv1d_v2: not supported by kvcache: operator "
                                "torch_npu.npu_fused_causal_conv1d_v2 (defined by torch-npu 2.14.0) is not emulated "
                                "on CPU (references/emulated_ops.md)")
    feature = unsupported_operator(UnemulatedFeatureError("npu_x", "quant_mode", "not emulated"), "m.py:4")
    assert "not supported by kvcache: npu_x: argument 'quant_mode'" in feature.render()
    assert unsupported_operator(UnemulatedOperatorError("torch_npu.npu_rms_norm_v9", "m.py:5"), "m.py:5") is None
    assert unsupported_operator(NpuOpError("npu_x", "a", "bad"), "m.py:6") is None  # the operator refused the call


def test_the_checkouts_own_operator_through_torch_npu_is_named_with_its_doc(tmp_path):
    """DeepSeek-V3.2's KV-offload path calls the repository's AscendC npu_gather_selection_kv_cache as torch_npu.*:
    exit 2 naming its doc in the checkout; without the doc the name stays the model's error."""
    from model_infer_kvcache.validators.checkout_run.support import unsupported_operator
    from model_infer_kvcache.validators.npu_ops.errors import UnemulatedOperatorError

    exc = UnemulatedOperatorError("torch_npu.npu_gather_selection_kv_cache", "m.py:7")
    assert unsupported_operator(exc, "m.py:7", tmp_path) is None
    (tmp_path / "ops" / "ascendc" / "docs").mkdir(parents=True)
    (tmp_path / "ops" / "ascendc" / "docs" / "custom-npu_gather_selection_kv_cache.md").write_text("# doc\n")
    line = unsupported_operator(exc, "m.py:7", tmp_path).render()
    assert "not supported by kvcache: operator torch_npu.npu_gather_selection_kv_cache (the checkout's own AscendC " \
           "operator, ops/ascendc/docs/custom-npu_gather_selection_kv_cache.md)" in line


def test_op_names_file_lists_every_func_of_the_yaml():
    import json

    import yaml
    from model_infer_kvcache.analyzer.operators.extract_schemas import _iter_func_strings
    from model_infer_kvcache.analyzer.operators.schemas import NAMES_PATH
    from shared_dirs import shared_path

    names = json.loads(NAMES_PATH.read_text())["releases"]
    for release, listed in names.items():
        text = shared_path(f"torch_npu-{release}", "torch_npu", "csrc", "aten",
                           "npu_native_functions_by_codegen.yaml").read_text()
        want = sorted({f.split("(", 1)[0].split(".", 1)[0].strip() for f in _iter_func_strings(yaml.safe_load(text))})
        assert listed == want, release


def _manifest(name: str):
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from shared_dirs import ROOT

    return analyze(AnalyzeRequest(config=str(ROOT / "tests" / "fixtures" / "configs" / f"{name}.json")))


def test_preflight_refuses_a_manifest_naming_no_reference():
    """No linear family is left without a reference (Ling-2.5's lightning attention has kvcache's own,
    validators/pipeline/ling_lightning.py), so the refusal remains only for a manifest an older kvcache wrote with
    linear_attention.reference null: exit 2 naming the family and what to do."""
    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.validators.checkout_run.support import preflight

    manifest = _manifest("ling_2_5")
    old = manifest.model_copy(update={"linear_attention": manifest.linear_attention.model_copy(
        update={"reference": None})})
    with pytest.raises(InputError) as info:
        preflight("c.json", old)
    line = info.value.render()
    assert line.startswith("c.json: model_type: not supported by kvcache: linear-attention layers of family "
                           "lightning_attention"), line
    assert "re-run kvcache analyze" in line


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next", "kimi_linear", "bailing_hybrid_kda", "ling_2_5",
                                  "qwen3_8b"])
def test_preflight_lets_configs_with_a_reference_through(name):
    """Gated delta net and KDA hybrids (transformers' classes), Ling-2.5's lightning attention (kvcache's reference
    from transformers' Ling-family code), whose framework-owned states check_state_blocks judges, and every
    attention-only config."""
    from model_infer_kvcache.validators.checkout_run.support import preflight

    preflight("c.json", _manifest(name))


def test_the_checkouts_own_operators_are_importable_and_named_when_used():
    import sys

    import torch
    from model_infer_kvcache.validators.checkout_run.support import unsupported_operator
    from model_infer_kvcache.validators.npu_ops import UnemulatedOperatorError
    from model_infer_kvcache.validators.standins import device_standins

    with device_standins():
        import custom_ops

        assert not hasattr(custom_ops, "npu_swiglu_group_quant") and not hasattr(torch.ops.custom, "npu_x")
        with pytest.raises(UnemulatedOperatorError) as info:
            torch.ops.custom.npu_swiglu_group_quant  # noqa: B018
    assert "custom_ops" not in sys.modules and "custom" not in torch.ops.__dict__  # taken off again
    line = unsupported_operator(info.value, "m.py:9").render()
    assert line == ("m.py:9: torch.ops.custom.npu_swiglu_group_quant: not supported by kvcache: operator "
                    "torch.ops.custom.npu_swiglu_group_quant (the checkout's own AscendC operator, "
                    "ops/ascendc/docs/custom-npu_swiglu_group_quant.md) is not emulated on CPU")


def _rank_step_lacking(payload, rank: int, world: int):
    """A rank step for run_ranks: rank 1 meets something kvcache does not support, rank 0 passes."""
    from model_infer_kvcache.validators.checkout_run.support import NotSupportedByKvcache
    from model_infer_kvcache.validators.pipeline.report import Report

    if rank == 1:
        raise NotSupportedByKvcache("modeling_x.py:7", "operator torch_npu.npu_y is not emulated", field="torch_npu.npu_y")
    return Report(backend="emulated", deploy_mode="framework", model_type="qwen3", manifest_hash="h")


def test_a_rank_that_meets_something_unsupported_makes_the_whole_run_exit_2():
    from pathlib import Path

    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.validators.pipeline.multi_rank import run_ranks

    cfg = Path(__file__).parent / "fixtures" / "configs" / "qwen3_8b.json"
    manifest = analyze(AnalyzeRequest(config=str(cfg), attn_tp_size=2))
    with pytest.raises(InputError) as info:
        run_ranks(_rank_step_lacking, None, 2, manifest)
    assert info.value.render() == ("modeling_x.py:7: torch_npu.npu_y: not supported by kvcache: operator "
                                   "torch_npu.npu_y is not emulated")


def _deepseek_manifest():
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from shared_dirs import ROOT

    return analyze(AnalyzeRequest(config=str(ROOT / "tests/fixtures/configs/deepseek_v3.json"),
                                  framework_api="G2", deploy_mode="framework"))


def _report():
    from model_infer_kvcache.validators.pipeline.report import Report

    return Report(backend="emulated", deploy_mode="framework", model_type="deepseek_v3", manifest_hash="")


def _call(layer: int, prefill: bool, mode: int, mask: bool) -> dict:
    return {"op": "npu_fused_infer_attention_score", "step": 1, "layer": layer, "is_prefill": prefill,
            "has_mask": mask, "sparse_mode": mode}


def test_mla_decode_mode3_is_judged_as_mode3_only_when_every_decode_call_makes_it():
    """Checkout mode: an MLA model whose every decode call passes sparse_mode 3 with the mask (upstream Kimi-K2)
    is judged against mode 3 (its result rests on a swept device question); a model that mixes modes, or a
    manifest without MLA, is judged as the manifest says (the mismatch is still named)."""
    from model_infer_kvcache.validators.checkout_run.checks import judged_manifest
    from model_infer_kvcache.validators.pipeline.fa_args import fa_call_mismatches

    m = _deepseek_manifest()
    assert m.mla.enabled and m.layers[0].sparse_mode.decode == 0 and m.layers[0].mask.decode == "none"
    uniform = [_call(0, True, 3, True), _call(0, False, 3, True), _call(1, False, 3, True)]
    report = _report()
    judged = judged_manifest(report, m, uniform)
    def mode_and_mask(manifest, call):  # the synthetic calls carry only these two arguments
        return [d for d in fa_call_mismatches(manifest, call) if d.startswith(("sparse_mode=", "mask="))]

    assert [mode_and_mask(judged, c) for c in uniform if not c["is_prefill"]] == [[], []]
    assert judged.layers[1].sparse_mode.decode == 3 and judged.layers[1].mask.decode == "causal_2048"
    assert any("mla_decode_sparse_mode3" in n for n in report.notes)
    mixed = [*uniform, _call(1, False, 0, False)]
    report = _report()
    assert judged_manifest(report, m, mixed).layers[1].sparse_mode.decode == 0
    assert not any("mla_decode_sparse_mode3" in n for n in report.notes)
    assert mode_and_mask(m, _call(1, False, 3, True)) == ["sparse_mode=3 (manifest 0)", "mask=True (manifest False)"]
    no_mask = [_call(1, False, 3, False)]
    assert judged_manifest(_report(), m, no_mask).layers[1].sparse_mode.decode == 0  # mode 3 alone: no reading


def test_only_a_layer_shaped_unlike_the_model_keeps_its_own_layout(tmp_path):
    """Checkout mode compares every FA call's layout with the manifest's, except on a layer whose shape the
    manifest's one layout was not chosen for (Gemma-4's 512-wide full layers): a packed model that passes BSND
    on an ordinary layer is still named (tests/test_checkout_negatives.py: packed-tnd-passed-as-bsnd)."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.validators.checkout_run.checks import own_layout_layers
    from model_infer_kvcache.validators.pipeline.fa_args import fa_call_mismatches
    from shared_dirs import ROOT

    m = analyze(AnalyzeRequest(config=str(ROOT / "tests/fixtures/configs/gemma4_26b_a4b.json")))
    calls = [{**_call(5, False, 0, False), "input_layout": "BSH"}, {**_call(4, False, 4, True), "input_layout": "BSH"}]
    report = _report()
    own = own_layout_layers(report, m, calls)
    assert own == {5} and "FullAttention decode BSH (head_dim 512)" in report.notes[0]
    assert not any(d.startswith("layout=") for d in fa_call_mismatches(m, calls[0], own_layout=own))
    assert "layout='BSH' (manifest 'TND')" in fa_call_mismatches(m, calls[1], own_layout=own)
    # the per-layer KV heads are the layer's: 2 on the full layer, 8 elsewhere
    assert not any(d.startswith("kv_heads=") for d in fa_call_mismatches(m, {**calls[0], "num_key_value_heads": 2}))
    assert "kv_heads=2 (manifest 8)" in fa_call_mismatches(m, {**calls[1], "num_key_value_heads": 2})


def test_uniform_prefill_stream_gives_every_prompt_the_longest_length():
    from model_infer_kvcache.validators.checkout_run.validate import ENGINE_STREAM
    from model_infer_kvcache.validators.pipeline.request_stream import Scenario

    stream = Scenario(first=((150, 8), (40, 5)), late=((60, 3),))
    uniform = stream.uniform_prefill()
    assert uniform.first == ((150, 8), (150, 5)) and uniform.late == ((150, 3),)
    assert uniform.max_concurrency == stream.max_concurrency and uniform.max_steps() >= stream.max_steps()
    crossed = ENGINE_STREAM.crossing(160, 128).uniform_prefill()
    assert {n for n, _ in crossed.first + crossed.late} == {max(n for n, _ in ENGINE_STREAM.crossing(160, 128).first)}


def test_uniform_prefill_is_a_checkout_mode_flag(tmp_path, capsys):
    from cli_support import invoke
    from shared_dirs import ROOT

    code, _, err = invoke(["validate", "--manifest", str(tmp_path / "m.json"), "--rendered", str(tmp_path),
                           "--config", str(ROOT / "tests/fixtures/configs/qwen3_8b.json"), "--uniform-prefill"], capsys)
    assert code == 2 and "--uniform-prefill: applies to the checkout mode (--model)" in err


def test_float32_noise_is_measured_on_the_reference():
    """A Qwen3 reference carries ~1e-6 of float32 rounding (the 1e-4 tolerance stands); the same model with
    its attention made near-one-hot (huge q/k norms) carries far more: what raises a checkout's tolerance."""
    import torch
    import transformers
    from model_infer_kvcache.validators.checkout_run.run import float32_noise

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    seqs = {0: list(range(40)), 1: list(range(5, 30))}
    calm = float32_noise(model, seqs)
    assert 0 < calm < 1e-5
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(40.0)
            layer.self_attn.k_norm.weight.mul_(40.0)
    assert float32_noise(model, seqs) > 10 * calm


def test_float32_noise_ignores_a_few_rows_that_flip():
    """A discrete flip on a few rows (an MoE routing tie that float32 and float64 decide differently) is not rounding
    noise: the measure is the rows' 0.99 quantile, so a handful of flipped rows leave it where the others put it,
    while a tolerance widened to their size would pass a real cache bug."""
    import torch
    from model_infer_kvcache.validators.checkout_run import run

    class Flipping(torch.nn.Module):
        """Logits equal in both precisions except float32 rounding, and rows 5 and 6 of the first sequence flip."""

        def forward(self, input_ids, use_cache=False):
            ids = input_ids[0].to(self.w.dtype)
            logits = torch.stack([ids * self.w, ids * 2 * self.w], -1)
            if self.w.dtype == torch.float32 and int(input_ids[0, 0]) == 0:
                logits[5:7] += 0.8
            return type("Out", (), {"logits": logits[None]})()

    model = Flipping()
    model.w = torch.nn.Parameter(torch.tensor(1.000001))
    seqs = {0: list(range(300)), 1: list(range(1, 301))}
    assert run.float32_noise(model, seqs) < 1e-3  # without the quantile: 0.8


def test_half_casts_made_while_building_become_the_comparison_dtype():
    import torch
    from model_infer_kvcache.validators.checkout_run.engine_run import HalfDtypesAs

    x = torch.randn(4) / 3
    with HalfDtypesAs(torch.float32):
        kept = x.to(torch.bfloat16)
        also = x.to(dtype=torch.float16)
        other = x.to(torch.float64)
        made = torch.zeros(2, dtype=torch.bfloat16)  # a buffer allocated in the device dtype (Legacy init_cache)
    assert kept.dtype == torch.float32 and torch.equal(kept, x) and also.dtype == torch.float32
    assert other.dtype == torch.float64 and made.dtype == torch.float32
    assert x.to(torch.bfloat16).dtype == torch.bfloat16  # undone on exit


def test_a_full_layers_mode_0_decode_is_its_choice_but_a_sliding_layers_is_not():
    """At one query token without rope, mode 0 without a mask sees what mode 3 with the mask sees on a layer
    without a window (upstream gemma_4's full layers): judged as mode 0. On a sliding layer it drops the band
    (keys outside the window become visible): still named. A manifest with MTP (q_len > 1) is judged as is."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.validators.checkout_run.checks import judged_manifest
    from model_infer_kvcache.validators.pipeline.fa_args import fa_call_mismatches
    from shared_dirs import ROOT

    m = analyze(AnalyzeRequest(config=str(ROOT / "tests/fixtures/configs/gemma4_26b_a4b.json")))
    assert m.layers[5].sparse_mode.decode == 3 and m.layers[4].sparse_mode.decode == 4
    calls = [_call(5, False, 0, False), _call(4, False, 0, False)]
    report = _report()
    judged = judged_manifest(report, m, calls)
    assert judged.layers[5].sparse_mode.decode == 0 and judged.layers[5].mask.decode == "none"
    assert judged.layers[4].sparse_mode.decode == 4  # the sliding layer keeps its band
    assert "sparse_mode=0 (manifest 4)" in fa_call_mismatches(judged, calls[1])
    assert any("1 full-attention layer(s) decode with sparse_mode 0" in n for n in report.notes)
    with_mtp = m.model_copy(update={"mtp": object()})
    assert judged_manifest(_report(), with_mtp, calls[:1]).layers[5].sparse_mode.decode == 3


def test_parameters_the_model_computes_are_told_from_weights_it_allocates(tmp_path):
    """A parameter built from a function's result (the Hadamard matrix) is the model's own; one built by an
    allocator (torch.empty) waits for the loader, and the load link still counts it as missing when unfilled."""
    from model_infer_kvcache.validators.checkout_run.run import model_computed_parameters

    (tmp_path / "indexer.py").write_text(
        "import torch\nfrom torch import nn\nclass A(nn.Module):\n    def __init__(self):\n"
        "        self.hadamard_matrix = nn.Parameter(get_had_pow2(128), requires_grad=False)\n"
        "        self.wq_b = nn.Parameter(torch.empty(8, 8), requires_grad=False)\n"
        "        self.bias = torch.nn.Parameter(torch.zeros(8))\n", encoding="utf-8")
    found = model_computed_parameters(tmp_path / "modeling_x.py")
    assert found == {"hadamard_matrix": "indexer.py:5"}


def test_sizes_a_config_class_pins_are_kept_only_when_the_config_agrees(tmp_path):
    """The checkout's config class fixes q_lora_rank = 1536: the tiny model keeps it when the real config says
    1536 too; a real config saying otherwise is named (the checkout ignores it) and the shrink stays."""
    from model_infer_kvcache.validators.checkout_run.registry import config_class_constants
    from model_infer_kvcache.validators.pipeline.tiny_model import keep_fixed

    folder = tmp_path / "models" / "m" / "models"
    folder.mkdir(parents=True)
    (folder / "configuration_m.py").write_text(
        "class Base:\n    def __init__(self, q_lora_rank=64, **kw):\n        self.q_lora_rank = q_lora_rank\n"
        "class MConfig(Base):\n    model_type = 'm_type'\n    def __init__(self, index_topk=2048, **kw):\n"
        "        super().__init__(**kw)\n        self.index_topk = index_topk\n        self.q_lora_rank = 1536\n"
        "class Other:\n    model_type = 'other'\n    def __init__(self):\n        self.vocab_size = 7\n",
        encoding="utf-8")
    fixed = config_class_constants(tmp_path, "m", "m_type")
    assert fixed == {"q_lora_rank": (1536, "configuration_m.py:9")}  # not index_topk (a parameter), not Other's
    notes: list[str] = []
    tiny = {"q_lora_rank": 64}
    keep_fixed(tiny, {"q_lora_rank": 1536}, fixed, notes)
    assert tiny["q_lora_rank"] == 1536 and "kept at 1536" in notes[0]
    tiny, notes = {"q_lora_rank": 64}, []
    keep_fixed(tiny, {"q_lora_rank": 2048}, fixed, notes)
    assert tiny["q_lora_rank"] == 64 and "the checkout ignores the config's value" in notes[0]


def test_parallel_sizes_follow_the_model_s_own_launch_yamls_only_where_they_agree():
    """bailing_2_5's yaml (attention TP over every rank) ties o_proj_tp_size to it and runs the MoE expert-parallel
    over every rank; the other snapshot models' yamls disagree among themselves (or keep attention TP 1), so their
    runs keep the defaults. The engine batch rounds the stream's concurrency up to a multiple of attention TP."""
    from model_infer_kvcache.validators.checkout_run.engine_run import engine_batch_size, shipped_layout
    from shared_dirs import upstream_head

    models = upstream_head() / "models"
    assert shipped_layout(models / "bailing_2_5" / "config", 2) == {"o_proj_tp_size": 2, "moe_tp_size": 1}
    for other in ("qwen3_5", "qwen3_moe", "deepseek_r1", "deepseek_v3_2_exp", "kimi_k2_thinking", "longcat_flash",
                  "gemma_4", "qwen"):
        assert shipped_layout(models / other / "config", 2) == {}, other
    assert [engine_batch_size(c, 2) for c in (2, 3, 4)] == [2, 4, 4] and engine_batch_size(3, 1) == 3


def test_mla_decode_layout_is_judged_as_the_model_lays_it_out_only_at_one_token():
    """BSND_NBSD at one query token per request is TND_NTD's rows and output order (upstream bailing_2_5's eager
    decode); a longer query, a prefill on the cache or mixed layouts are judged as the manifest says."""
    from model_infer_kvcache.validators.checkout_run.checks import mla_decode_layout_judged
    from model_infer_kvcache.validators.pipeline.report import Report

    manifest = _manifest("ling_2_5")
    assert manifest.mla.enabled and manifest.fa.input_layout == "TND_NTD"

    def call(layout="BSND_NBSD", q_shape=(4, 1, 8, 512), prefill=False):
        return {"op": "npu_fused_infer_attention_score", "input_layout": layout, "q_shape": q_shape,
                "is_prefill": prefill}

    report = Report(backend="emulated", deploy_mode="framework", model_type="x", manifest_hash="0", dtype="float32",
                    tolerance=1e-4)
    judged = mla_decode_layout_judged(report, manifest, [call(), call()])
    assert judged.fa.input_layout == "BSND_NBSD" and "judged as BSND_NBSD calls" in report.notes[-1]
    for calls in ([call(q_shape=(4, 2, 8, 512))], [call(prefill=True)], [call(), call("TND_NTD", (4, 8, 512))],
                  [call("BNSD_NBSD")]):
        assert mla_decode_layout_judged(report, manifest, calls) is manifest
