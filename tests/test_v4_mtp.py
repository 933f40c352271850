"""DeepSeek-V4 compressed attention with MTP (issue 38): speculative-decode verify steps (1 + next_n query tokens per
request) through the window, CSA and HCA branches, both deployment modes, against transformers (which builds no MTP
head: the main model's verify rows are judged, validators/pipeline/spec_decode.py). The compressed kind places the
stream's prompts (validators/kinds/compressed.spec_prompts) so that one verify step's last draft completes a group of
every rate and is rejected (the next step completes that group again with another token), and another's draft
completes a CSA group after a row of the same step. Negative controls: a rejected draft left in the compressor state
(the state ring sized as without drafts) and a verify row that sees an entry a later draft of its step completed."""

from __future__ import annotations

import pytest
from model_infer_kvcache.validators.kinds.compressed import spec_prompts
from model_infer_kvcache.validators.pipeline.request_stream import Scenario
from model_infer_kvcache.validators.pipeline.spec_decode import PROMPTS
from validators_support import check, mistaken_report, render_case, run_validate

CONFIG = "deepseek_v4"  # window + CSA + HCA layers
MTP = {"num_nextn_predict_layers": 1}  # DeepseekV4Config's default
ATTN, RUNNER = "kvcache_attention.py", "kvcache_runner.py"
AS_WRITTEN = "as written: "  # the given render's run (the CPU narrows index_topk in a copy)
SPEC = "speculative decode (next_n="
OPS, INIT = "rendered code runs without operator errors", "_init_kvcache caches are"
# the main stream kept short (CSA / HCA decoding is judged by tests/test_csa_render.py): the verify steps are the point
MAIN = Scenario(first=((140, 2), (20, 2)), late=((30, 2),), max_concurrency=2, release_requests=1)


def _case(tmp_path, mode: str, next_n: int | None = None):
    kw = {"deploy_mode": mode} | ({} if next_n is None else {"next_n": next_n})
    return render_case(tmp_path, CONFIG, MTP, **kw)


@pytest.mark.parametrize("mode, next_n", [("framework", None), ("standalone", 3)])
def test_verify_steps_through_the_compressed_branches_match_transformers(tmp_path, mode, next_n):
    manifest, rendered, cfg = _case(tmp_path, mode, next_n)
    report = run_validate(manifest, rendered, cfg, scenario=MAIN)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    spec = check(report, SPEC).measured
    want = next_n or 1
    assert spec["max_abs_diff"] <= 1e-9 and spec["rejected"] > 0 and spec["accepted"] > 0, spec
    assert {"all", "none"} <= set(spec["patterns"]), spec
    assert check(report, SPEC).name.startswith(f"{SPEC}{want})")
    if mode == "standalone":  # the runner's state ring grew by next_n - 1 (CSA 8 -> 10, HCA 128 -> 130)
        # entries completed by rejected drafts were poisoned (NaN) with the drafts' states, and never read
        assert spec["rejected_entries"] > 0, spec
        text = (rendered / RUNNER).read_text(encoding="utf-8")
        assert "CSA_STATE_RING = 10" in text and "HCA_STATE_RING = 130" in text


def test_the_stream_rejects_a_draft_that_completes_a_group_of_every_rate():
    """The placed prompts (next_n 1 and 3): request 1's first verify step (every draft rejected) ends at the last token
    of a 128-token group past the window (so of a 4-token group too); request 0's (every draft accepted) at the end of
    a 4-token group, its first row seeing fewer entries than the CPU top-k."""
    from types import SimpleNamespace

    for next_n in (1, 3):
        m = SimpleNamespace(mtp=SimpleNamespace(speculative_tokens=next_n), compressed=SimpleNamespace(
            compress_rates={"csa": 4, "hca": 128}, csa_layers=[1], hca_layers=[2], sliding_window=128))
        (short, _), (long, _) = spec_prompts(m, PROMPTS)
        assert (short + next_n + 1) % 4 == 0 and (short + 1) // 4 < 16
        assert (long + next_n + 1) % 128 == 0 and long > 128
    m.compressed.csa_layers = []  # HCA only: both placed at its rate
    assert all((n + 3 + 1) % 128 == 0 for n, _ in spec_prompts(m, PROMPTS))


def test_a_state_ring_without_room_for_drafts_fails_by_name(tmp_path):
    """The HCA state ring sized as without MTP (HCA_RATIO tokens) at next_n 3: the runner's state slots are short of
    the manifest's state window plus the drafts (V110, before any step runs)."""
    case = render_case(tmp_path, "deepseek_v4_hca", MTP, deploy_mode="standalone", next_n=3)
    report = mistaken_report(case, r"(?m)^HCA_STATE_RING = 130$", "HCA_STATE_RING = HCA_RATIO", MAIN, name=RUNNER)
    init = check(report, INIT)
    assert not init.passed and "sfa_kv_state" in init.detail and "130" in init.detail, init.detail


def test_a_rejected_draft_left_in_the_compressor_state_fails_by_name(tmp_path, monkeypatch):
    """The same ring mistake where V110 would not see it (its rule patched to the window alone, as if the manifest's
    reading were wrong too): at next_n 3 a rejected draft overwrites, in the CSA ring, the oldest token of the group
    the next step completes again (the validator poisons what rejected drafts wrote: NaN reaches the verify rows), and
    only the verify logits fail (plain decode never writes past what it keeps)."""
    from model_infer_kvcache.validators.kinds import compressed as kind

    monkeypatch.setattr(kind, "state_ring_tokens", lambda window, next_n: window)
    report = mistaken_report(_case(tmp_path, "standalone", 3), r"(?m)^HCA_STATE_RING = 130$\n^CSA_STATE_RING = 10$",
                             "HCA_STATE_RING = HCA_RATIO\nCSA_STATE_RING = 2 * CSA_RATIO", MAIN, name=RUNNER)
    assert check(report, AS_WRITTEN + INIT).passed and check(report, AS_WRITTEN + "logits vs transformers").passed
    spec = check(report, AS_WRITTEN + SPEC)  # the aliased token is a rejected draft's, poisoned after its step
    assert not spec.passed and "step" in spec.detail, (spec.detail, spec.measured)


def test_a_verify_row_that_sees_a_later_drafts_entry_fails_by_name(tmp_path):
    """The indexer's visible entries at decode taken per request (its kv length after the step, right at q_len 1): a
    verify row then sees the CSA entry a later draft of its step completed; with fewer visible entries than the top-k
    it lists that entry, which the shared-KV kernel refuses by name."""
    report = mistaken_report(_case(tmp_path, "standalone"), r"visible = \(positions \+ 1\) // CSA_RATIO",
                             "visible = (positions + 1) // CSA_RATIO if forward_metadata.is_prefill else "
                             "forward_metadata.actual_seq_lengths_kv.to(torch.int64)[rows] // CSA_RATIO", MAIN)
    assert not check(report, AS_WRITTEN + OPS).passed
    assert "cmp_sparse_indices" in check(report, AS_WRITTEN + OPS).detail, check(report, AS_WRITTEN + OPS).detail
