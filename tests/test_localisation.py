"""Localisation of a numeric failure: the report's first lines name the first diverging layer, the sub-module
(attention input, cache write, attention output, MLP) and the operator calls there with their file:line.

Checkout mode: copies of the snapshot's qwen model file (``test_checkout_negatives``' edits), one with RoPE
moved below the cache writes (the cache holds un-rotated keys), one doing that in layer 1 only (the first
diverging layer is not always 0), and the unedited copy (no localisation). Rendered mode: a render whose FA
call passes a softmax scale without the square root, and the clean render (no localisation). Unit cases of
``localise`` cover the rest of the decision (MLP only, nothing in the layers, a replay that differs).
"""

from __future__ import annotations

import json

import pytest
import torch
from model_infer_kvcache.validators.pipeline.localise import Capture, ReferenceActivations, localise
from test_checkout_negatives import MISTAKES, edited_copy, validate_copy
from validators_support import mutate, render_case, run_validate

ROPE_AFTER_WRITE = next(m for m in MISTAKES if m.id == "rope-after-cache-write")
# The same mistake in layer 1 only: the K write of that layer takes the keys before RoPE.
_K_WRITE = """            k_cache.view(-1, self.num_key_value_heads_per_rank, self.head_dim),
            tmp_slot_mapping.view(-1, 1),
            key_states,
"""
LAYER1_UNROTATED = (
    ("        cos, sin = cos_sin\n", "        key_before_rope = key_states\n        cos, sin = cos_sin\n"),
    (_K_WRITE, _K_WRITE.replace("            key_states,\n",
                                "            key_before_rope if self.layer_idx == 1 else key_states,\n")),
)


def _line_of(text: str, call: str, next_line: str) -> int:
    """1-based line of ``call`` whose following line contains ``next_line`` (the one such call)."""
    lines = text.splitlines()
    hits = [i + 1 for i in range(len(lines) - 1) if call in lines[i] and next_line in lines[i + 1]]
    assert len(hits) == 1, hits
    return hits[0]


def _first_lines(report) -> list[str]:
    return report.to_markdown().splitlines()[:6]


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    from test_checkout_negatives import _manifest

    out = str(tmp_path_factory.mktemp("manifests"))
    return lambda family: _manifest(family, None, out)


@pytest.fixture(scope="module")
def qwen_manifest(manifests):
    return manifests("qwen")


def test_checkout_keys_cached_before_rope_name_the_cache_write(tmp_path, qwen_manifest):
    copy = edited_copy("qwen", ROPE_AFTER_WRITE.edits, tmp_path)
    report = validate_copy("qwen", copy, qwen_manifest)
    assert not report.passed
    loc = report.localisation
    assert (loc["step"], loc["layer"], loc["submodule"]) == (0, 0, "cache write"), loc
    text = copy.read_text(encoding="utf-8")
    k_line = _line_of(text, "torch_npu.npu_scatter_nd_update_(", "k_cache.view")
    v_line = _line_of(text, "torch_npu.npu_scatter_nd_update_(", "v_cache.view")
    assert loc["where"] == [f"modeling_qwen.py:{k_line} (exec_qkv)"]
    by_cache = {c["cache"]: c for c in loc["calls"]}
    assert by_cache["k_cache"]["at"].startswith(f"modeling_qwen.py:{k_line}")
    assert "differs from the reference's rotated K" in by_cache["k_cache"]["finding"]
    assert "equals the reference's K before RoPE" in by_cache["k_cache"]["finding"]
    # The V write is listed with its line but is right: no finding on it.
    assert by_cache["v_cache"]["at"].startswith(f"modeling_qwen.py:{v_line}")
    assert "finding" not in by_cache["v_cache"]
    # Where to look comes first: the Markdown's first bullet and the JSON's first key after the verdict.
    first = _first_lines(report)
    assert first[2].startswith("- **定位(首个偏离)**") and f"modeling_qwen.py:{k_line}" in first[2], first
    assert "cache write" in first[2]
    assert list(json.loads(report.to_json()))[:2] == ["passed", "localisation"]


def test_checkout_mistake_in_layer_1_names_layer_1(tmp_path, qwen_manifest):
    copy = edited_copy("qwen", LAYER1_UNROTATED, tmp_path)
    report = validate_copy("qwen", copy, qwen_manifest)
    assert not report.passed
    loc = report.localisation
    assert (loc["layer"], loc["submodule"]) == (1, "cache write"), loc
    k_line = _line_of(copy.read_text(encoding="utf-8"), "torch_npu.npu_scatter_nd_update_(", "k_cache.view")
    assert loc["where"] == [f"modeling_qwen.py:{k_line} (exec_qkv)"]


def test_checkout_decode_reading_before_its_write_names_the_fa_call_and_the_later_writes(tmp_path, manifests):
    """gpt-oss with the decode cache write moved below the FA call: the first failure is a decode step; its
    FA call read NaN (the token's slot not yet written) and the layer's writes come after it."""
    mistake = next(m for m in MISTAKES if m.id == "decode-writes-after-attention")
    copy = edited_copy("gpt_oss", mistake.edits, tmp_path)
    report = validate_copy("gpt_oss", copy, manifests("gpt_oss"))
    loc = report.localisation
    assert not report.first_failure["is_prefill"]
    assert (loc["layer"], loc["submodule"]) == (0, "attention output"), loc
    text = copy.read_text(encoding="utf-8")
    lines = text.splitlines()
    decode_fa = [i + 1 for i in range(len(lines) - 2) if "npu_fused_infer_attention_score_v2(" in lines[i]
                 and "self.k_cache.view" in lines[i + 2]]  # the decode call reads the cache
    assert len(decode_fa) == 1
    fa_line = decode_fa[0]
    (call,) = loc["calls"]
    assert call["at"] == f"modeling_gpt_oss.py:{fa_line} (forward)"
    assert "not finite" in call["finding"] and "cache writes come after this call" in call["finding"]


def test_checkout_passing_run_reports_no_localisation(tmp_path, qwen_manifest):
    report = validate_copy("qwen", edited_copy("qwen", (), tmp_path), qwen_manifest)
    assert report.passed
    assert report.localisation == {} and report.first_failure == {}
    assert "localisation" not in report.to_dict()
    assert "定位" not in report.to_markdown()


def test_rendered_wrong_softmax_scale_names_the_attention_output(tmp_path):
    manifest, rendered, config = render_case(tmp_path, "qwen3_8b", deploy_mode="framework", framework_api="G2")
    mutate(rendered, r"scale=SOFTMAX_SCALE,", "scale=1.0 / HEAD_DIM,", count=1)  # head_dim^-1, not ^-0.5
    report = run_validate(manifest, rendered, config)
    assert not report.passed
    loc = report.localisation
    assert (loc["step"], loc["layer"], loc["submodule"]) == (0, 0, "attention output"), loc
    fa_line = _line_of((rendered / "kvcache_attention.py").read_text(encoding="utf-8"),
                       "torch_npu.npu_fused_infer_attention_score(", "query_states")
    assert loc["where"] == [f"kvcache_attention.py:{fa_line} (paged_attention)"]
    (call,) = loc["calls"]  # the layer's FA call; the (correct) cache writes are not this sub-module's
    assert call["op"] == "npu_fused_infer_attention_score"
    assert "scale=0.0078125, expected 0.088388348" in call["finding"]
    first = _first_lines(report)
    assert first[2].startswith("- **定位(首个偏离)**") and "attention output" in first[2], first
    assert f"kvcache_attention.py:{fa_line}" in first[2]


def test_rendered_passing_run_reports_no_localisation(tmp_path):
    manifest, rendered, config = render_case(tmp_path, "qwen3_8b", deploy_mode="framework", framework_api="G2")
    report = run_validate(manifest, rendered, config)
    assert report.passed
    assert report.localisation == {} and "localisation" not in report.to_dict()
    assert "定位" not in report.to_markdown()


# ------------------------------------------------------------------------------------------- localise() alone
def _capture(layers: int, seen: dict, ids: list[int]) -> Capture:
    cap = Capture(torch.nn.Module(), 0, lambda: 0, (), lambda t: None)
    cap.blocks = [(None, None, None)] * layers
    cap.seen = seen
    cap.input_ids = torch.tensor(ids)
    return cap


def _parts(x: torch.Tensor) -> dict:
    return {"attention input": x, "attention output": x + 1, "MLP": x + 2}


def _reference(layers: list[dict]) -> ReferenceActivations:
    ref = ReferenceActivations()
    ref.seen = dict(enumerate(layers))
    return ref


def test_localise_names_the_mlp_of_the_layer_where_only_it_differs():
    x = torch.randn(3, 8, dtype=torch.float64)
    got = {0: _parts(x), 1: {**_parts(x), "MLP": x + 2.5}}
    loc = localise(_capture(2, got, [5, 6, 7]), _reference([_parts(x), _parts(x)]), [0, 1, 2], [0, 1, 2],
                   [5, 6, 7], 1e-6)
    assert (loc["layer"], loc["submodule"]) == (1, "MLP")
    assert loc["max_abs_diff"] == pytest.approx(0.5)


def test_localise_rows_select_the_request_only():
    """Another request's rows in the same step may differ (they are judged in their own chunk)."""
    x = torch.randn(4, 8, dtype=torch.float64)
    packed = torch.cat([x[:2], torch.full((1, 8), 9.0, dtype=torch.float64), x[2:]])  # row 2: another request
    got = {0: _parts(packed)}
    loc = localise(_capture(1, got, [1, 2, 0, 3, 4]), _reference([_parts(x)]), [0, 1, 3, 4], [0, 1, 2, 3],
                   [1, 2, 3, 4], 1e-6)
    assert loc["layer"] is None and "after the last decoder layer" in loc["headline"]
    wrong_rows = localise(_capture(1, got, [1, 2, 0, 3, 4]), _reference([_parts(x)]), [0, 1, 2, 3], [0, 1, 2, 3],
                          [1, 2, 0, 3], 1e-6)
    assert (wrong_rows["layer"], wrong_rows["submodule"]) == (0, "attention input")


def test_localise_refuses_a_replay_that_saw_other_tokens():
    x = torch.randn(2, 8, dtype=torch.float64)
    loc = localise(_capture(1, {0: _parts(x + 1)}, [5, 6]), _reference([_parts(x)]), [0, 1], [0, 1], [5, 7], 1e-6)
    assert loc["layer"] is None and "did not reproduce" in loc["headline"]


def test_localise_lists_the_fa_arguments_that_differ():
    """Attention output differs: its FA call is listed with the scale against the reference's scaling and the
    arguments the manifest decided otherwise (``judge``); a call with nothing wrong carries no finding."""
    x = torch.randn(2, 8, dtype=torch.float64)
    cap = _capture(2, {0: _parts(x), 1: {**_parts(x), "attention output": x + 3}}, [4, 5])
    ref = _reference([_parts(x), _parts(x)])
    ref.scaling = {0: 0.125, 1: 0.125}
    fa = {"kind": "fa", "op": "npu_fused_infer_attention_score", "has_mask": True, "output": None}
    cap.calls = [{**fa, "layer": 0, "at": "a.py:1 (f)", "scale_arg": "scale", "scale": 0.125,
                  "keywords": {"sparse_mode": 3}},
                 {**fa, "layer": 1, "at": "a.py:1 (f)", "scale_arg": "scale", "scale": 0.0625,
                  "keywords": {"sparse_mode": 0}}]
    seen = []

    def judge(call):
        seen.append(call)
        return ["sparse_mode=0 (manifest 3)", "scale=0.0625 (manifest 0.125)"] if call["layer"] == 1 else []

    loc = localise(cap, ref, [0, 1], [0, 1], [4, 5], 1e-6, judge=judge)
    assert (loc["layer"], loc["submodule"]) == (1, "attention output")
    (call,) = loc["calls"]
    assert call["finding"] == "scale=0.0625, expected 0.125 (the reference's attention scaling); " \
                              "sparse_mode=0 (manifest 3)"
    assert seen == [{"op": "npu_fused_infer_attention_score", "layer": 1, "has_mask": True, "sparse_mode": 0}]
    assert loc["where"] == ["a.py:1 (f)"]
