"""Ling-2.5 (upstream models/bailing_2_5: MLA full layers + lightning-attention linear layers whose recurrent states
the framework owns) against kvcache's Ling-2.5 reference (validators/pipeline/ling_lightning.py: transformers'
BailingHybrid code with a torch lightning attention).

The reference's lightning attention is checked on its own against a per-token recurrence written here from the
formula, with slopes computed here, and against transformers' MiniMaxLightningAttention where the two coincide;
the upstream file passes in the checkout's real engine, and realistic state mistakes in an edited copy fail by name.
The engine runs need the snapshot (``KVCACHE_SHARED``; skipped with the reason otherwise).
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from checkout_support import ORACLE
from shared_dirs import ROOT, upstream_head

CONFIG = ROOT / "tests" / "fixtures" / "configs" / "ling_2_5.json"
MODEL_FILE = "models/bailing_2_5/models/modeling_bailing_moe_v2_5.py"


def _ling_factor(layer_idx: int, num_layers: int) -> float:
    return 1 - (layer_idx - 1) / (num_layers - 1) + 1e-5  # upstream modeling_bailing_moe_v2_5.py:1253


def _rates(heads: int) -> torch.Tensor:
    """OpenNLPLab's get_slopes for a power-of-two head count: start * ratio ** h, start = ratio = 2 ** (-8 / H)."""
    start = 2 ** (-(2 ** -(math.log2(heads) - 3)))
    return torch.tensor([start * start ** h for h in range(heads)], dtype=torch.float64)


def _recurrence(q, k, v, log_decay, scale):
    """S_t = exp(g) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t from S_0 = 0, one token at a time ([B, S, H, D])."""
    b, s, h, d = q.shape
    state = q.new_zeros(b, h, d, v.shape[-1])
    out = []
    for t in range(s):
        state = torch.exp(log_decay)[None, :, None, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhd,bhdv->bhv", q[:, t] * scale, state))
    return torch.stack(out, dim=1)


def test_lightning_attention_is_the_per_token_recurrence_with_ling_2_5_s_slopes():
    from model_infer_kvcache.validators.pipeline.ling_lightning import lightning_attention, lightning_slopes

    heads, layers = 8, 5
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, heads, 16, generator=g, dtype=torch.float64) for _ in range(3))
    for layer in (0, 2, 4):
        want = -_rates(heads) * _ling_factor(layer, layers)
        torch.testing.assert_close(lightning_slopes(heads, layer, layers), want, rtol=1e-15, atol=0)
        got = lightning_attention(q, k, v, want, 16 ** -0.5)
        torch.testing.assert_close(got, _recurrence(q, k, v, want, 16 ** -0.5), rtol=0, atol=1e-12)
    # the comparison tells slopes apart: MiniMax's layer factor (1 - l / (L - 1 + 1e-5) + 1e-5) is another decay
    minimax = -_rates(heads) * (1 - 2 / (layers - 1 + 1e-5) + 1e-5)
    assert (lightning_attention(q, k, v, lightning_slopes(heads, 2, layers), 0.25)
            - _recurrence(q, k, v, minimax, 0.25)).abs().max() > 1e-2
    with pytest.raises(ValueError, match="power-of-two"):
        lightning_slopes(12, 0, layers)  # OpenNLPLab's ALiBi workaround series, which MiniMax's formula is not


def test_lightning_attention_matches_transformers_minimax_where_they_coincide():
    """MiniMaxLightningAttention (block algorithm, blocks of 4 over 11 tokens) on the same q, k, v: its attention
    before the norm and gate equals lightning_attention with MiniMax's own slopes and no query scale, and its
    per-head rates are the reference's before each side's layer factor."""
    import transformers
    from model_infer_kvcache.validators.pipeline.ling_lightning import lightning_attention, lightning_slopes
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    heads, dim, layers, layer = 4, 8, 3, 1
    config = transformers.MiniMaxConfig(hidden_size=32, num_attention_heads=heads, head_dim=dim,
                                        num_hidden_layers=layers, block_size=4)
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # its rates and decay buffers computed in float64, not cast afterwards
    try:
        module = MiniMaxLightningAttention(config, layer)
    finally:
        torch.set_default_dtype(before)
    minimax_rates = module.slope_rate.reshape(-1)
    minimax_factor = 1 - layer / (layers - 1 + 1e-5) + 1e-5  # modeling_minimax.py:154
    torch.testing.assert_close(-lightning_slopes(heads, layer, layers) / _ling_factor(layer, layers),
                               minimax_rates / minimax_factor, rtol=1e-12, atol=0)
    hidden = torch.randn(1, 11, 32, dtype=torch.float64)
    seen = {}
    module.norm.register_forward_pre_hook(lambda mod, args: seen.setdefault("attn", args[0]))
    with torch.no_grad():
        module(hidden, position_embeddings=None, attention_mask=None)
        qkv = module.act_fn(module.qkv_proj(hidden)).reshape(1, 11, heads, 3 * dim)
        q, k, v = torch.split(qkv, dim, dim=3)
        ours = lightning_attention(q, k, v, -minimax_rates, 1.0).reshape(1, 11, heads * dim)
    torch.testing.assert_close(ours, seen["attn"], rtol=0, atol=1e-12)


def test_the_reference_layer_runs_its_slopes_and_query_scale(monkeypatch):
    """The linear layer module hands the core its own layer's slopes (Ling-2.5's factor) and head_dim ** -0.5:
    swapping the core for the per-token recurrence with the test's slopes leaves its output unchanged."""
    from model_infer_kvcache.validators.pipeline import ling_lightning

    heads, dim, layers, layer = 4, 16, 5, 3
    config = types.SimpleNamespace(num_attention_heads=heads, head_dim=dim, hidden_size=24, use_qkv_bias=False,
                                   use_qk_norm=True, rms_norm_eps=1e-6, group_norm_size=2, use_bias=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 600000.0,
                                                    "partial_rotary_factor": 0.5},
                                   num_hidden_layers=layers, linear_silu=False)
    torch.manual_seed(0)
    module = ling_lightning.LingLightningAttention(config, layer).double()
    hidden = torch.randn(2, 9, 24, dtype=torch.float64)
    with torch.no_grad():
        want = module(hidden)
        monkeypatch.setattr(ling_lightning, "lightning_attention", lambda q, k, v, slope, scale: _recurrence(
            q, k, v, -_rates(heads) * _ling_factor(layer, layers), dim ** -0.5))
        torch.testing.assert_close(module(hidden), want, rtol=0, atol=1e-12)
    assert module.inv_freq.numel() == dim * 0.5 / 2  # rotary over head_dim * partial_rotary_factor


def _validate(**kw):
    from model_infer_kvcache.validators.checkout_run import ENGINE_QUICK, CheckoutRequest, validate_checkout

    # attention TP 2: at one rank the model builds no communication groups and its MoE reads them
    # (modeling_bailing_moe_v2_5.py:423); its shipped yaml runs the MoE expert-parallel over every rank. The
    # transformers oracle alone (here kvcache's Ling-2.5 reference): not a test of the recompute oracle
    # (tests/checkout_support.py)
    return validate_checkout(CheckoutRequest(str(upstream_head()), "bailing_2_5", str(CONFIG), attn_tp_size=2,
                                             **{"sweep_readings": False, "scenario": ENGINE_QUICK, "oracle": ORACLE,
                                                **kw}))


@pytest.mark.slow
def test_bailing_2_5_passes_in_the_real_engine_against_the_ling_2_5_reference():
    """Unequal prompts in one prefill, a late request admitted into a freed state block, padded decode rows: every
    check passes on both ranks, V223 judged the lightning states of every linear layer."""
    report = _validate()
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    by_id: dict[str, list] = {}
    for c in report.checks:
        by_id.setdefault(c.id, []).append(c)
    assert len(by_id["V301"]) == 2 and all(c.measured["max_abs_diff"] <= report.tolerance for c in by_id["V301"])
    assert report.tolerance == 1e-4
    assert len(by_id["V223"]) == 2 and all(c.measured["judged"] > 0 for c in by_id["V223"])
    assert all(c.measured["calls"] > 0 for c in by_id["V209"])  # the MLA layer's decode FA calls
    notes = "\n".join(report.notes)
    assert "reference: kvcache's Ling-2.5 reference (validators/pipeline/ling_lightning.py)" in notes
    assert "moe_tp_size 1, o_proj_tp_size 2" in notes  # the model's own launch layout
    assert "{'gla_recurrent_state': 'recurrent_state'}" in notes


# Realistic state mistakes in an edited copy of the upstream model file.
MISTAKES = {
    # prefill continues from what the state block holds (the previous owner's state, NaN once freed)
    "prefill_reads_the_state_block": (
        "            if not is_prefill:\n                initial_state = self.gla_state_cache.index_select(0, state_ids)",
        "            initial_state = self.gla_state_cache.index_select(0, state_ids)",
        "V401"),
    # the Legacy habit: the batch row as the state slot, not the request's block
    "state_slot_is_the_batch_row": (
        "                state_ids = table[:, 0].to(torch.int32)",
        "                state_ids = torch.arange(rows, dtype=torch.int32)",
        "V223"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_lightning_state_mistake_fails_by_name(tmp_path, mistake):
    from model_infer_kvcache.validators.pipeline.request_stream import Scenario

    old, new, check_id = MISTAKES[mistake]
    text = (upstream_head() / MODEL_FILE).read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    copy = tmp_path / "modeling_bailing_moe_v2_5.py"
    copy.write_text(text.replace(old, new), encoding="utf-8")
    # short: two prompts, a late one admitted into the block the first frees, padded decode rows
    stream = Scenario(first=((50, 2), (30, 4)), late=((40, 3),), max_concurrency=2, release_requests=0)
    report = _validate(model_file=str(copy), scenario=stream)
    assert not report.passed
    failed = {c.id for c in report.failed()}
    assert check_id in failed, [(c.id, c.name, c.detail) for c in report.failed()]
    if check_id == "V223":
        assert "wrote block(s)" in next(c for c in report.failed() if c.id == "V223").detail
