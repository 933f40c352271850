"""The newer model folders of the snapshot in the real engine (issue 23): each runs to the numeric comparison,
or stops with a precise line: the model's own file:line (exit 1), or "not supported by kvcache: <what>" (exit 2).

Configs are transformers' own config classes at their defaults (the published architectures), written to a
temporary config.json the way a user would save one. Needs the snapshot (``KVCACHE_SHARED``; skipped with the
reason otherwise).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from checkout_support import ORACLE
from shared_dirs import ROOT, upstream_head


def _default_config(tmp_path: Path, cls_name: str, **overrides) -> Path:
    import transformers

    data = {**getattr(transformers, cls_name)().to_dict(), **overrides}
    path = tmp_path / f"{cls_name}.json"
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    return path


def _validate(model: str, config: Path, **kw):
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout

    # the transformers oracle alone: these tests are not about the recompute oracle (tests/checkout_support.py)
    return validate_checkout(CheckoutRequest(str(upstream_head()), model, str(config),
                                             **{"sweep_readings": False, "oracle": ORACLE, **kw}))


def _cli(model: str, config: Path, *extra: str):
    return subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", "--framework-root",
                           str(upstream_head()), "--model", model, "--config", str(config), "--no-sweep", *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)


def _numeric(report) -> list:
    return [c for c in report.checks if "logits vs transformers" in c.name]


@pytest.mark.slow
def test_longcat_flash_passes_in_the_real_engine(tmp_path):
    """LongcatFlashConfig() (28 decoder layers of two MLA sublayers, 512 routed + 256 identity experts): the
    checkout's own config class reads num_layers (its num_hidden_layers is a read-only alias) and rope_theta
    (4.x), and the decode MoE sends identity experts through dispatch/combine's copy experts."""
    report = _validate("longcat_flash", _default_config(tmp_path, "LongcatFlashConfig"))
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    numeric = _numeric(report)
    assert numeric and numeric[0].measured["max_abs_diff"] <= 1e-4 and numeric[0].measured["requests"] == 6
    notes = "\n".join(report.notes)
    assert "init link on 56 layers" in notes  # two attention sublayers per decoder layer
    assert "reads num_hidden_layers as self.num_layers" in notes
    assert "takes rope_theta (transformers 4.x): written from rope_parameters (1e+07)" in notes
    # its entries are cache_nope/cache_rope: compared by width, not by the manifest's names
    assert "'cache_nope': 'nope_cache'" in notes


@pytest.mark.slow
def test_kimi_k2_thinking_as_shipped_passes_and_names_its_device_dependencies(tmp_path):
    """DeepseekV3Config() under kimi_k2_thinking at attention TP 2 (its MoE TP path): the decode FA call passes
    sparse_mode=3 with the mask at one query token per request, outside the op docs' supported combinations
    for MLA at Q_S 1 (references/device_questions.md). Under the reading upstream relies on (same as mode 0)
    it passes; the sweep reruns it under the other two and the report names the dependency and its line. The
    numeric pass also shows npu_mla_prolog_v3 (PA_NZ cache writes, interleaved RoPE, W_uk absorb) computing what
    transformers' DeepseekV3 attention computes; that the documented mode-0 call consults no reading is
    tests/test_npu_ops_attention.py's. 16 query heads instead of the published 128 (a third of the time, the sweep
    runs the model three times): the decode call's mode, the prolog and MLA's latent cache do not depend on the head
    count; DeepSeek-R1's file runs the published 128 (tests/test_checkout_run.py)."""
    # finalize_skip1_alone (its MoE's other operator question) is fixed: deepseek_r1's test sweeps it
    config = _default_config(tmp_path, "DeepseekV3Config", num_attention_heads=16, num_key_value_heads=16)
    report = _validate("kimi_k2_thinking", config, attn_tp_size=2,
                       sweep_readings=True, readings=(("finalize_skip1_alone", "added"),))
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    numeric = _numeric(report)
    assert len(numeric) == 2 and all(c.measured["max_abs_diff"] <= 1e-4 for c in numeric)
    assert "mla_decode_sparse_mode3" in report.consulted
    notes = "\n".join(report.notes)
    assert "its decode calls are judged as mode 3 calls" in notes
    assert ("the model depends on the device reading mla_decode_sparse_mode3: it passes under same_as_mode0 and "
            "fails under deviates, rejected") in notes
    src = (upstream_head() / "models/kimi_k2_thinking/models/modeling_deepseek.py").read_text().splitlines()
    rejected = next(n for n in report.notes if n.startswith("under mla_decode_sparse_mode3=rejected"))
    line = int(re.search(r"modeling_deepseek\.py:(\d+): NpuOpError: npu_fused_infer_attention_score", rejected)
               .group(1))
    assert "npu_fused_infer_attention_score" in src[line - 1]
    deviates = next(n for n in report.notes if n.startswith("under mla_decode_sparse_mode3=deviates"))
    assert "logits vs transformers" in deviates  # judged numerically, not by its arguments


GEMMA4 = ROOT / "tests" / "fixtures" / "configs" / "gemma4_26b_a4b.json"  # gemma-4-26B-A4B, the folder's model


@pytest.mark.slow
def test_gemma_4_refuses_variable_length_prefill_at_its_own_line(tmp_path):
    """The folder's model raises on a prefill batch of unequal prompts (its own check, before its 4-D views):
    the model's line, exit 1, not a kvcache gap."""
    out = _cli("gemma_4", GEMMA4, "--report", str(tmp_path / "r.json"))
    assert out.returncode == 1, out.stderr[-2000:]
    src = (upstream_head() / "models/gemma_4/models/modeling_gemma4.py").read_text().splitlines()
    report = json.loads((tmp_path / "r.json").read_text())
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "checkout model runs in the engine without errors")
    line = int(re.match(r"modeling_gemma4\.py:(\d+): ValueError: variable-length prefill is not supported", detail)
               .group(1))
    assert "raise ValueError" in src[line - 1]


@pytest.mark.slow
def test_gemma_4_with_uniform_prefill_passes_under_the_window_reading_it_relies_on(tmp_path):
    """gemma-4-26B-A4B with --uniform-prefill: per-layer shapes (full layers 2 KV heads of 512, K=V), the
    window shrunk to cross on CPU, the full layers' BSH decode and mode-0 decode judged as the model's own
    choices, bf16 rope tables made in float32. Its sliding layers pass pre_tokens = sliding_window, so it
    passes under window_pre_tokens=inclusive and fails under the documented exclusive band rule (one key
    too many), like upstream gpt-oss: the report names the dependency."""
    # band_at_single_query is fixed (gpt-oss's test sweeps it): the sweep reruns the window question only
    from model_infer_kvcache.validators.checkout_run.validate import ENGINE_QUICK

    # the quick stream still crosses the shrunk window and admits a late request (the readings sweep runs it twice)
    report = _validate("gemma_4", GEMMA4, uniform_prefill=True, sweep_readings=True, scenario=ENGINE_QUICK,
                       readings=(("band_at_single_query", "honoured"),))
    assert all(c.passed for c in report.checks if c.link in ("init", "runtime")), \
        [(c.name, c.detail) for c in report.failed()]
    assert {c.id for c in report.failed()} <= {"V301", "V302"}  # exclusive (the default): one key too many
    notes = "\n".join(report.notes)
    assert ("the model depends on the device reading window_pre_tokens: it passes under inclusive and fails "
            "under exclusive") in notes
    assert "under window_pre_tokens=inclusive the model survives" in notes
    assert "--uniform-prefill: every prompt is" in notes and "window 1024 is too long for CPU sequences" in notes
    assert "decode with sparse_mode 0 and no mask" in notes and "FullAttention decode BSH (head_dim 512)" in notes
    assert report.localisation["layer"] == 0 and "modeling_gemma4.py" in report.localisation["headline"]


@pytest.mark.slow
def test_gemma_4_values_cached_as_keys_fail_above_its_measured_tolerance(tmp_path):
    """Negative control for the measured tolerance: the K = V full layers writing their keys into v_cache too
    (values are v_norm(k_proj), keys are rope(k_norm(k_proj)): a plausible confusion) fail the numeric link by
    far more than the noise-based tolerance, under the reading the model passes with, and the localisation
    names the full layer's cache write."""
    src = (upstream_head() / "models/gemma_4/models/modeling_gemma4.py").read_text(encoding="utf-8")
    old = ("        else:\n            self._update_cache(inputs.slot_mapping, inputs.key, inputs.value)\n"
           "            # Contiguous BSH view")
    assert src.count(old) == 1
    copy = tmp_path / "modeling_gemma4.py"
    copy.write_text(src.replace(old, old.replace("inputs.key, inputs.value", "inputs.key, inputs.key")), "utf-8")
    from model_infer_kvcache.validators.checkout_run.validate import ENGINE_QUICK

    report = _validate("gemma_4", GEMMA4, uniform_prefill=True, model_file=str(copy), scenario=ENGINE_QUICK,
                       readings=(("window_pre_tokens", "inclusive"),))
    numeric = _numeric(report)[0]
    assert not numeric.passed and numeric.measured["max_abs_diff"] > 10 * report.tolerance
    assert report.localisation["layer"] == 5 and "_update_cache" in report.localisation["headline"]


@pytest.mark.slow
def test_bailing_2_5_cannot_be_built_on_one_rank(tmp_path):
    """Ling-2.5 (the folder's own config class, saved as its hub config.json) at one rank (--attn-tp-size 1: the
    user's layout, kept; left to kvcache it runs at TP 2, tests/test_checkout_layout.py): the upstream file builds its
    communication groups (hccl_comm_dict) only when the world size is above 1, and its MoE reads them
    unconditionally (modeling_bailing_moe_v2_5.py:423), so the model cannot be built on one rank: exit 1 at that
    line, the hint naming --attn-tp-size 2 (where it passes against kvcache's Ling-2.5 reference:
    tests/test_checkout_lightning.py)."""
    config = ROOT / "tests" / "fixtures" / "configs" / "ling_2_5.json"
    report = tmp_path / "report.json"
    out = _cli("bailing_2_5", config, "--report", str(report), "--attn-tp-size", "1")
    assert out.returncode == 1, out.stderr[-2000:]
    failed = [ln for ln in out.stderr.splitlines() if ln.startswith("FAILED")]
    assert failed == ["FAILED [runtime] checkout model runs in the engine without errors: "
                      "modeling_bailing_moe_v2_5.py:423: AttributeError: 'NoneType' object has no attribute 'get' "
                      "(the model builds its communication groups only with more than one rank, and this line "
                      "reads them: validate with --attn-tp-size 2)"], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and json.loads(report.read_text())["passed"] is False


def _qwen3_5(tmp_path, **kw):
    from model_infer_kvcache.validators.pipeline.request_stream import Scenario

    # attention TP 2: at one rank its MoE takes the expert-parallel path, whose group it registers only for EP > 1.
    # Four prompts (Legacy: one batch, the engine's batch size, an even one at TP 2), two past a 64-token chunk of
    # the gated-delta prefill and two within it.
    stream = Scenario(first=((120, 3), (40, 3), (90, 3)), late=((60, 3),), max_concurrency=3, release_requests=0)
    return _validate("qwen3.5", _default_config(tmp_path, "Qwen3_5MoeTextConfig"), attn_tp_size=2,
                     scenario=stream, **kw)


@pytest.mark.slow
def test_qwen3_5_runs_as_legacy_and_passes_with_uniform_prefill(tmp_path):
    """Upstream qwen3_5 owns its caches (init_cache: contiguous K/V rows and per-row conv / recurrent states, no
    get_cache_info): the engine makes no KVCacheManager, the stream is one batch prefilled together, and the
    logits judge the model's own caches and gated-delta states against transformers' Qwen3.5-MoE. Its
    device=torch.npu.current_device() buffers are CPU tensors and its bfloat16 casts run in float32."""
    report = _qwen3_5(tmp_path, uniform_prefill=True)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    numeric = _numeric(report)
    assert len(numeric) == 2 and all(c.measured["max_abs_diff"] <= report.tolerance for c in numeric)
    assert numeric[0].measured["requests"] == 4 and numeric[0].measured["steps"] >= 3  # one batch, then decodes
    assert not any(c.id == "V401" for c in report.checks)  # nothing poisoned: no pool, no freed rows
    notes = "\n".join(report.notes)
    assert "Legacy: Qwen3_5MoeForCausalLM owns its caches (init_cache, no get_cache_info)" in notes
    assert "one batch of 4 requests prefilled together" in notes
    assert report.provenance["model_file"].endswith("models/qwen3_5/models/modeling_qwen3_5_moe.py")


@pytest.mark.slow
def test_qwen3_5_mixes_up_a_prefill_batch_of_unequal_prompts(tmp_path):
    """The same model with prompts of 120, 40, 90 and 60 tokens in its one prefill: the first request's prefill
    logits are right, a later request's differ at once. Read from its prefill: token i's row is bucketize(i,
    cu_seq_lens[1:], right=False), so the first token of every request but the first lands in the previous row (how
    far that moves a request's logits depends on its length: with 150, 40, 300, 60 the second request fails first,
    here the third), and the conv state is the padded tail of each row (both right only when every prompt has the
    longest length, as --uniform-prefill makes them)."""
    report = _qwen3_5(tmp_path)
    assert not report.passed
    logits = _numeric(report)[0]
    assert not logits.passed and re.match(r"first failure at step 0 request [123]\b", logits.detail), logits.detail
    src = (upstream_head() / "models/qwen3_5/models/modeling_qwen3_5_moe.py").read_text()
    assert "torch.bucketize(token_idx, cu_seq_lens[1:], right=False)" in src


@pytest.mark.slow
def test_an_operator_kvcache_lacks_is_exit_2_naming_it_and_the_model_line(tmp_path):
    """A real torch-npu operator the emulation lacks (npu_fast_gelu, in both committed releases): exit 2, one line
    naming the op and the model file:line; an operator no release defines stays the model's error (exit 1)."""
    src = upstream_head() / "models" / "qwen" / "models" / "modeling_qwen.py"
    text = src.read_text(encoding="utf-8")
    assert "torch_npu.npu_rms_norm(" in text
    copy = tmp_path / "modeling_qwen.py"
    copy.write_text(text.replace("torch_npu.npu_rms_norm(", "torch_npu.npu_fast_gelu(", 1), encoding="utf-8")
    line = next(i for i, t in enumerate(copy.read_text().splitlines(), 1) if "npu_fast_gelu" in t)
    out = _cli("qwen3_8b", ROOT / "tests" / "fixtures" / "configs" / "qwen3_8b.json", "--model-file", str(copy))
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"modeling_qwen.py:{line}: torch_npu.npu_fast_gelu: not supported by kvcache: " \
        "operator torch_npu.npu_fast_gelu (defined by the pinned release) is not emulated" in errors[0], errors


@pytest.mark.slow
def test_hy3_passes_against_transformers_hy_v3(tmp_path):
    """transformers 5.24 ships HYV3 (model_type hy_v3): the reference exists. HYV3Config() carries no token ids
    and the checkout's embedding compares its padding_idx with ints, so the config names them (as a saved
    config.json does); per-layer mlp_layer_types are cut with the layers and restored for the init link."""
    report = _validate("hy3", _default_config(tmp_path, "HYV3Config", pad_token_id=0, bos_token_id=1, eos_token_id=2))
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert _numeric(report)[0].measured["max_abs_diff"] <= 1e-4
