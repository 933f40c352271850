"""Negative controls of checkout mode: integration mistakes in copies of the snapshot's model files.

Each case copies a model file of the pinned cann-recipes-infer snapshot, makes one small textual
edit an engineer could plausibly make while integrating the KV cache, validates the copy in the
checkout's own engine (``CheckoutRequest.model_file``) and asserts that the check naming that
mistake fails. The unedited copy of every family passes (positive control), so each failure is due
to its edit. Every edit must apply exactly as written (the snapshot is pinned): an edit that no
longer matches fails the test instead of silently validating the unedited file.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from checkout_support import ORACLE
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from shared_dirs import upstream_head

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "fixtures" / "configs"

# A short stream: one prompt over a 128-token block, a late admit into a finished request's
# blocks, padded decode (fewer live requests than the batch size); no sequential-release tail.
NEG_STREAM = Scenario(first=((140, 2), (7, 2), (40, 2)), late=((20, 2),), max_concurrency=3, release_requests=0)


@dataclass(frozen=True)
class Family:
    model: str  # key of executor/core/support_models.py
    config: str  # tests/fixtures/configs/<config>.json: the real config the tiny model is built from
    model_file: str  # relative to the checkout root
    # Device readings the unedited file needs (upstream gpt-oss passes pre_tokens = W: inclusive window).
    readings: tuple[tuple[str, str], ...] = ()
    tp: int | None = None  # attention TP the family validates at (None: the manifest's)


FAMILIES = {
    "qwen": Family("qwen3_8b", "qwen3_8b", "models/qwen/models/modeling_qwen.py"),
    # At one rank Qwen3-MoE takes its expert-parallel path, which needs an EP group the model registers
    # only for EP > 1: it validates at attention TP 2 (MoE TP 2).
    "qwen3_moe": Family("qwen3_moe", "qwen3_30b_a3b", "models/qwen3_moe/models/modeling_qwen3_moe.py", tp=2),
    "gpt_oss": Family("gpt_oss", "gpt_oss_20b", "models/gpt_oss/models/modeling_gpt_oss.py",
                      (("window_pre_tokens", "inclusive"),)),
    # DeepSeek-V3 config, MLA latent + rope caches; TP 2 for the same reason as Qwen3-MoE. Its MoE passes
    # skip1 without skip2 to npu_moe_finalize_routing: the file needs finalize_skip1_alone=added (the default).
    "deepseek": Family("deepseek_r1", "deepseek_v3", "models/deepseek_r1/models/modeling_deepseek.py", tp=2),
}


@dataclass(frozen=True)
class Mistake:
    id: str
    family: str
    edits: tuple[tuple[str, str], ...]  # (old, new): ``old`` occurs exactly once in the file
    check: str  # the failing check's name (prefix)
    detail: str = ""  # a substring of the failing check's detail that names the mistake
    tp: int | None = None  # None: the family's
    slow: bool = False
    xfail: str = ""  # why the driver does not (yet) fail the named check (strict: a pass is reported)


# Edits of models/qwen/models/modeling_qwen.py (QwenAttention.exec_qkv and its cache entries).
_ROPE = """        cos, sin = cos_sin
        query_states, key_states = torch_npu.npu_apply_rotary_pos_emb(
            query_states, key_states, cos, sin, layout="TND"
        )
"""
_V_WRITE = """        torch_npu.npu_scatter_nd_update_(
            v_cache.view(-1, self.num_key_value_heads_per_rank, self.head_dim),
            tmp_slot_mapping.view(-1, 1),
            value_states,
        )
"""
_KV_LEN = "            actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv\n"
_Q_LEN = "            actual_seq_qlen = forward_metadata.actual_seq_lengths_cu_q\n"


MISTAKES = [
    Mistake("cache-not-written", "qwen", ((_V_WRITE, ""),),
            "every cache entry is written every step", "v_cache"),
    Mistake("old-cache-write-left-in-place", "qwen",
            ((_V_WRITE, _V_WRITE + """        if is_prefill:  # the pre-migration prefill write: the prompt's tokens at the start of the cache
            torch_npu.npu_scatter_nd_update_(
                v_cache.view(-1, self.num_key_value_heads_per_rank, self.head_dim),
                torch.arange(q_len, device=value_states.device).view(-1, 1),
                value_states,
            )
"""),),
            "cache writes use the layer's own group's slot_mapping", "v_cache: slots are not"),
    Mistake("softmax-scale-without-sqrt", "qwen",
            (("self.scale_fa = 1 / (self.head_dim ** 0.5)", "self.scale_fa = 1 / self.head_dim"),),
            "FA call arguments match the manifest", "scale=0.0078125"),
    Mistake("band-sparse-mode-on-a-causal-layer", "qwen", (("sparse_mode = 3\n", "sparse_mode = 4\n"),),
            "FA call arguments match the manifest", "sparse_mode=4 (manifest 3)"),
    Mistake("causal-mask-dropped", "qwen", (("atten_mask=attention_mask,", "atten_mask=None,"),),
            "FA call arguments match the manifest", "mask=False (manifest True)"),
    Mistake("v1-keyword-on-v2", "qwen", (("softmax_scale=self.scale_fa,", "scale=self.scale_fa,"),),
            "checkout model runs in the engine without errors", "Unknown keyword argument 'scale'"),
    Mistake("kv-len-mutated-in-layer", "qwen",
            ((_KV_LEN, _KV_LEN + "            if not is_prefill:\n"
                                 "                actual_seq_kvlen.add_(1)  # count the token written above\n"),),
            "kv_len reaches every layer as the engine set it", "step 1 layer 1"),
    Mistake("kv-len-before-the-write", "qwen",
            ((_KV_LEN, "            # decode: the tokens cached before this step (the pre-migration convention)\n"
                       "            actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv - (0 if is_prefill else 1)\n"),),
            "kv_len reaches every layer as the engine set it", "!= [141, 141, 141]"),
    Mistake("rope-after-cache-write", "qwen",
            ((_ROPE, ""), ("        key_states, value_states = k_cache, v_cache\n",
                           _ROPE + "        key_states, value_states = k_cache, v_cache\n")),
            "logits vs transformers", "first failure at step 0"),
    Mistake("packed-tnd-passed-as-bsnd", "qwen",
            (('            input_layout="TND",\n', '            input_layout="BSND",\n'),
             ("        attn_output, _ = fa_ops.npu_fused_infer_attention_score_v2(\n            query_states,\n",
              "        attn_output, _ = fa_ops.npu_fused_infer_attention_score_v2(\n"
              "            query_states.unsqueeze(0),\n")),
            "FA call arguments match the manifest", "layout='BSND' (manifest 'TND')"),
    Mistake("cumulative-q-lengths-replaced-by-per-request", "qwen",
            ((_Q_LEN, "            actual_seq_qlen = forward_metadata.actual_seq_lengths_q\n"),),
            "checkout model runs in the engine without errors", "actual_seq_qlen"),
    Mistake("cache-heads-are-query-heads", "qwen",
            (("                num_head=self.num_key_value_heads_per_rank,\n                dtype=cache_dtype,\n"
              "                block_size=self.block_size,\n                needs_block=True,\n"
              "                tensor_setter=lambda tensor, layer=self: setattr(layer, \"k_cache\", tensor),\n",
              "                num_head=self.num_heads_per_rank,\n                dtype=cache_dtype,\n"
              "                block_size=self.block_size,\n                needs_block=True,\n"
              "                tensor_setter=lambda tensor, layer=self: setattr(layer, \"k_cache\", tensor),\n"),),
            "cache entries match the manifest", "k_cache"),
    Mistake("cache-dtype-hard-coded", "qwen",
            (("cache_dtype = torch.bfloat16 if config.torch_dtype is None else config.torch_dtype",
              "cache_dtype = torch.float16"),),
            "cache entries match the manifest", "torch.float16"),
    Mistake("cache-tensor-copied-in-setter", "qwen",
            (('setattr(layer, "k_cache", tensor)', 'setattr(layer, "k_cache", tensor.clone())'),
             ('setattr(layer, "v_cache", tensor)', 'setattr(layer, "v_cache", tensor.clone())')),
            "each layer's FA", "FA key is no allocated cache tensor"),
    Mistake("kv-heads-not-divided-by-tp", "qwen",
            (("num_key_value_heads=self.num_key_value_heads_per_rank,", "num_key_value_heads=self.num_key_value_heads,"),),
            "FA call arguments match the manifest", "kv_heads=8 (manifest 4)", tp=2, slow=True),
    Mistake("cache-heads-not-divided-by-tp", "qwen",
            (("num_head=self.num_key_value_heads_per_rank,\n                dtype=cache_dtype,\n"
              "                block_size=self.block_size,\n                needs_block=True,\n"
              "                tensor_setter=lambda tensor, layer=self: setattr(layer, \"v_cache\", tensor),",
              "num_head=self.num_key_value_heads,\n                dtype=cache_dtype,\n"
              "                block_size=self.block_size,\n                needs_block=True,\n"
              "                tensor_setter=lambda tensor, layer=self: setattr(layer, \"v_cache\", tensor),"),),
            "cache entries match the manifest", "v_cache", tp=2, slow=True),
] + [
    # Edits of models/qwen3_moe/models/modeling_qwen3_moe.py (prefill on fresh K/V, decode on the cache), TP 2.
    Mistake("prefill-kv-lengths-not-prefix-sums", "qwen3_moe",
            (("actual_seq_kvlen = forward_metadata.actual_seq_lengths_cu_kv if is_prefill",
              "actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv if is_prefill"),),
            "checkout model runs in the engine without errors", "needs each query length <= its KV length",
            slow=True),
    Mistake("decode-attends-fresh-keys", "qwen3_moe",
            (("            key_states, value_states, key_scale, value_scale = (\n",
              "            _, _, key_scale, value_scale = (\n"),),
            "each layer's FA", "(decode): FA key is no allocated cache tensor", slow=True),
] + [
    # Edits of models/gpt_oss/models/modeling_gpt_oss.py: sliding (even) and full (odd) layers, two groups.
    Mistake("slots-of-the-other-group", "gpt_oss",
            (('slot_mapping[self.attn_type].view(-1, 1),\n            key_states',
              'slot_mapping["SlidingWindow"].view(-1, 1),\n            key_states'),
             ('slot_mapping[self.attn_type].view(-1, 1),\n            value_states',
              'slot_mapping["SlidingWindow"].view(-1, 1),\n            value_states')),
            "cache writes use the layer's own group's slot_mapping", "layer 1 k_cache"),
    Mistake("block-table-of-the-other-group", "gpt_oss",
            (("block_table=block_table[self.attn_type],", 'block_table=block_table["SlidingWindow"],'),),
            "FA block_table is the layer's own group's", "layer 1"),
    Mistake("sliding-layer-parity-flipped", "gpt_oss",
            (('if config.layer_types[layer_idx] == "sliding_attention" else None',
              "if layer_idx % 2 == 1 else None"),),
            "cache entries match the manifest", "layer 0 k_cache"),
    Mistake("sliding-layers-from-the-wrong-config-field", "gpt_oss",
            (('if config.layer_types[layer_idx] == "sliding_attention" else None',
              'if getattr(config, "use_sliding_window", True) else None'),),
            "cache entries match the manifest", "layer 1 k_cache"),
    Mistake("window-off-by-one", "gpt_oss",
            (("self.sliding_window = config.sliding_window if", "self.sliding_window = config.sliding_window - 1 if"),),
            "cache entries match the manifest", "window"),
    Mistake("decode-writes-after-attention", "gpt_oss",
            (("""            self.update_cache(slot_mapping, key_states, value_states)
            attn_output, attn_weights = torch.ops.npu.npu_fused_infer_attention_score_v2(""",
              """            attn_output, attn_weights = torch.ops.npu.npu_fused_infer_attention_score_v2("""),
             ("""                block_size=self.block_size,
                )
""", """                block_size=self.block_size,
                )
            self.update_cache(slot_mapping, key_states, value_states)
""")),
            "outputs finite with unowned cache"),
] + [
    # Edits of models/deepseek_r1/models/modeling_deepseek.py (MLA, YaRN scale), TP 2.
    Mistake("yarn-mscale-applied-once", "deepseek",
            (("self.softmax_scale = self.softmax_scale * mscale * mscale",
              "self.softmax_scale = self.softmax_scale * mscale"),),
            "FA call arguments match the manifest", "scale", slow=True),
    Mistake("mla-backend-flag-dropped", "deepseek", (("            is_mla_backend=True,\n", ""),),
            "is_mla_backend", slow=True),
    Mistake("rope-cache-sized-as-the-latent", "deepseek",
            (("                cache_name=\"rope_cache\",\n                attn_type=self.attn_type,\n"
              "                dim=self.config.qk_rope_head_dim,",
              "                cache_name=\"rope_cache\",\n                attn_type=self.attn_type,\n"
              "                dim=self.config.kv_lora_rank,"),),
            "cache entries match the manifest", "rope_cache", slow=True),
]


@cache
def _manifest(family: str, tp: int | None, out: str) -> str:
    """The manifest analyzed once per family (and TP) from the config and the checkout."""
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest
    from model_infer_kvcache.validators.checkout_run.validate import load_or_analyze

    fam = FAMILIES[family]
    root = upstream_head()
    req = CheckoutRequest(framework_root=str(root), model=fam.model, config=str(CONFIGS / f"{fam.config}.json"),
                          attn_tp_size=tp)
    path = Path(out) / f"{family}-tp{tp or 1}.json"
    path.write_text(load_or_analyze(req, root).to_json(), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("manifests"))
    return lambda family, tp=None: _manifest(family, tp, out)


def edited_copy(family: str, edits, dest: Path) -> Path:
    """A copy of the family's model file with ``edits`` applied (each must match exactly once)."""
    src = upstream_head() / FAMILIES[family].model_file
    text = src.read_text(encoding="utf-8")
    for old, new in edits:
        assert text.count(old) == 1, f"edit does not apply to {src.name}: {old[:80]!r} occurs {text.count(old)} times"
        text = text.replace(old, new)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / src.name
    if edits:
        out.write_text(text, encoding="utf-8")
    else:
        shutil.copyfile(src, out)
    return out


def validate_copy(family: str, model_file: Path, manifest: str, tp: int | None = None):
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout

    fam = FAMILIES[family]
    # the transformers oracle alone: what each mistake fails is named by its check, not by the recompute oracle,
    # whose agreement on these edits is tests/test_checkout_recompute.py's (tests/checkout_support.py)
    return validate_checkout(CheckoutRequest(
        framework_root=str(upstream_head()), model=fam.model, config=str(CONFIGS / f"{fam.config}.json"),
        manifest=manifest, attn_tp_size=tp, model_file=str(model_file), scenario=NEG_STREAM, sweep_readings=False,
        readings=fam.readings, oracle=ORACLE))


def _plain_name(check) -> str:
    """The check's name without the ``rank N: `` prefix of a multi-rank report."""
    return re.sub(r"^rank \d+: ", "", check.name)


def _failures(report) -> str:
    return "; ".join(f"[{c.link}] {c.name}: {c.detail}"[:300] for c in report.failed()) or "(none: the report passed)"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_unedited_copy_passes(family, tmp_path, manifests):
    """Positive control: the copy itself validates, so a failure below is due to its edit."""
    tp = FAMILIES[family].tp
    report = validate_copy(family, edited_copy(family, (), tmp_path), manifests(family, tp), tp)
    assert report.passed, _failures(report)
    assert report.provenance["model_file"] == str((tmp_path / Path(FAMILIES[family].model_file).name).resolve())


def _marks(m: Mistake) -> list:
    marks = [pytest.mark.slow] if m.slow else []
    return marks + ([pytest.mark.xfail(reason=m.xfail, strict=True)] if m.xfail else [])


@pytest.mark.parametrize("mistake", [pytest.param(m, id=m.id, marks=_marks(m)) for m in MISTAKES])
def test_mistake_is_caught_by_its_check(mistake: Mistake, tmp_path, manifests):
    copy = edited_copy(mistake.family, mistake.edits, tmp_path)
    tp = mistake.tp or FAMILIES[mistake.family].tp
    report = validate_copy(mistake.family, copy, manifests(mistake.family, tp), tp)
    assert not report.passed
    named = [c for c in report.checks if _plain_name(c).startswith(mistake.check)]
    assert named, f"no check named {mistake.check!r}; failures: {_failures(report)}"
    assert any(not c.passed for c in named), f"{mistake.check!r} passed; failures: {_failures(report)}"
    if mistake.detail:
        assert any(mistake.detail in c.detail for c in named if not c.passed), _failures(report)


def test_the_controls_cover_the_acceptance():
    """At least 15 different mistakes caught by their named check, over every family with a positive control."""
    assert len({m.id for m in MISTAKES}) == len(MISTAKES)
    assert len({m.edits for m in MISTAKES}) == len(MISTAKES)
    assert len([m for m in MISTAKES if not m.xfail]) >= 15
    assert {m.family for m in MISTAKES} == set(FAMILIES)
