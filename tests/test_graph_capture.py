"""Graph-mode decode (issue 39): the rendered npugraph_ex decode captured once per batch size and replayed over the
whole request stream, in both deployment modes, and four realistic graph-mode mistakes failing by name with the
line that holds them.

The capture is torch.compile(fullgraph=True) of the decode forward, the engine's own compile
(executor/utils/graph_utils.py), with the emulated operators as single torch.ops.npu nodes
(validators/npu_ops/fake_shapes.py). Each replayed step is compared with the eager step on the same state and its
logits go to the transformers comparison.
"""

from __future__ import annotations

import pytest
from dataclasses import replace

from model_infer_kvcache.validators.pipeline.request_stream import QUICK
from validators_support import check, mutate, render_case, run_validate

pytestmark = pytest.mark.slow

CAPTURE = "graph mode ("  # V228, either graph mode
NO_RECAPTURE = "graph mode: no capture after warm-up"
HOST_SHAPED = "graph mode: no tensor inside the captured step is shaped or filled from a host length"
VS_EAGER = "graph mode: replayed decode logits vs eager"
PADDING = "decode padded to the per-DP batch size; padded rows write only the null block"


def _line_of(path, needle: str) -> int:
    lines = path.read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(lines, 1) if needle in line)


FA_LENGTHS_CALL = r"(\n(\s+)q_lens, kv_lens = fa_lengths\(forward_metadata\))"


def _after_fa_lengths(tmp_path, added: str, marker: str):
    """(report, line) of the Qwen3 npugraph_ex render with ``added`` right after its fa_lengths() call, ``marker``
    locating the added line."""
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", exe_mode="npugraph_ex")
    mutate(rendered, FA_LENGTHS_CALL, r"\1\n\2" + added, count=1)
    line = _line_of(rendered / "kvcache_attention.py", marker)
    return run_validate(manifest, rendered, cfg), line


@pytest.mark.parametrize("config,mode,exe_mode", [
    ("qwen3_8b", "framework", "npugraph_ex"), ("qwen3_8b", "standalone", "npugraph_ex"),
    ("deepseek_v2_lite", "framework", "npugraph_ex"), ("deepseek_v2_lite", "standalone", "npugraph_ex"),
    # ge_graph: compiled static, decode FA through torchair.ops with the length tensors
    ("qwen3_8b", "standalone", "ge_graph"), ("deepseek_v2_lite", "framework", "ge_graph")])
def test_rendered_graph_decode_captures_once_and_replays_the_stream_as_eager(tmp_path, config, mode, exe_mode):
    manifest, rendered, cfg = render_case(tmp_path, config, exe_mode=exe_mode, deploy_mode=mode)
    # Qwen3: the quick stream with 32 sequential requests after it, every one admitted into freed blocks or rows
    long = config == "qwen3_8b" and exe_mode == "npugraph_ex"
    report = run_validate(manifest, rendered, cfg, scenario=replace(QUICK, release_requests=32) if long else QUICK)
    assert report.passed, report.failures()
    capture, again = check(report, f"graph mode ({exe_mode}"), check(report, NO_RECAPTURE)
    assert capture.passed and capture.measured["captures"] == 1
    # one batch size, the padded decode batch (the engine's batch_size_per_dp_rank / the runner's rows: the stream's
    # concurrency), replayed over the stream with admission and release
    assert again.passed and again.measured["batch_rows"] == [QUICK.max_concurrency]
    replays = check(report, VS_EAGER).measured["replays"]
    assert replays >= (40 if long else 15), replays
    assert ("dynamic=False" in capture.name) == (exe_mode == "ge_graph")
    assert check(report, VS_EAGER).measured["max_diff"] <= 1e-9
    assert check(report, HOST_SHAPED).passed
    if mode == "standalone":
        assert check(report, PADDING).passed


SPEC = "speculative decode (next_n="
SPEC_CALLS = "speculative-decode verify steps"
# DeepSeek-V3's MTP cases: a shorter main stream (admission, a late request, two sequential ones) before the verify
# steps, which are the point here
MTP_STREAM = replace(QUICK, first=((150, 4), (40, 3), (60, 3)), late=((30, 2),), release_requests=2)
# with 16 heads instead of its published 128: the captured widths are batch x tokens whatever the head count, and a
# render of 128 heads validates through a second, CPU-sized run (20-30 s a case instead of a few)
MTP_HEADS = {"num_attention_heads": 16, "num_key_value_heads": 16}


@pytest.mark.parametrize("mode,exe_mode", [("standalone", "npugraph_ex"), ("framework", "ge_graph")])
def test_mtp_verify_steps_capture_a_width_of_their_own_and_replay_as_eager(tmp_path, mode, exe_mode):
    # DeepSeek-V3 with its MTP layer (next_n 1): decode steps and verify steps (1 + next_n tokens per row, padded
    # rows too) are two captured shapes, each replayed, and the verify logits still match transformers
    manifest, rendered, cfg = render_case(tmp_path, "deepseek_v3", MTP_HEADS, exe_mode=exe_mode, deploy_mode=mode)
    report = run_validate(manifest, rendered, cfg, scenario=MTP_STREAM)
    assert report.passed, [c for c in report.checks if not c.passed]
    rows = QUICK.max_concurrency
    assert check(report, f"graph mode ({exe_mode}").measured["captures"] == 2
    assert check(report, NO_RECAPTURE).measured["batch_rows"] == [rows, rows * 2]
    assert check(report, VS_EAGER).measured["max_diff"] <= 1e-9
    spec = check(report, SPEC)
    assert spec.passed and spec.measured["verify_steps"] == 3 and {"all", "none"} <= set(spec.measured["patterns"])
    assert check(report, SPEC_CALLS).measured["calls"] > 0  # the verify steps' FA calls, torchair.ops' included


def test_padded_verify_rows_given_one_token_fail_by_name(tmp_path):
    # The runner pads a verify step as a decode step (one token per padded row): the step is not the captured shape
    # of batch x (1 + next_n) tokens
    manifest, rendered, cfg = render_case(tmp_path, "deepseek_v3", MTP_HEADS, exe_mode="npugraph_ex", deploy_mode="standalone")
    mutate(rendered, r"slot_mapping, 1 \+ next_n\)", "slot_mapping)", name="kvcache_runner.py")
    report = run_validate(manifest, rendered, cfg, scenario=MTP_STREAM)
    padding = check(report, PADDING)
    assert not padding.passed and "x 2 token(s)" in padding.detail, padding
    assert "kvcache_runner.py:" in padding.measured["runner"] and not report.passed


def test_the_render_passes_fa_host_lists_on_decode_only(tmp_path):
    _, rendered, _ = render_case(tmp_path, "qwen3_8b", exe_mode="npugraph_ex")
    code = (rendered / "kvcache_attention.py").read_text(encoding="utf-8")
    assert "return forward_metadata.actual_seq_lengths_cu_list_q, forward_metadata.actual_seq_lengths_list_kv" in code
    assert "actual_seq_lengths=q_lens," in code and "actual_seq_lengths_kv=kv_lens," in code


# ------------------------------------------------------------------ the four mistakes, each named with its line
def test_a_length_read_with_item_inside_decode_breaks_the_capture_at_its_line(tmp_path):
    report, line = _after_fa_lengths(
        tmp_path, "kv_lens = [int(n.item()) for n in forward_metadata.actual_seq_lengths_kv]", "n.item()")
    broken = check(report, CAPTURE)
    assert not broken.passed and f"kvcache_attention.py:{line}" in broken.detail, broken.detail
    assert check(report, VS_EAGER).measured["replays"] <= 1  # the stream stops replaying at the broken capture
    assert check(report, "logits vs transformers").passed  # the eager numbers are right: only the capture fails


def test_a_block_table_cut_to_the_current_longest_request_is_named_at_its_line(tmp_path):
    # "only the blocks the longest request needs": the width then follows the step's lengths, not the static width
    report, line = _after_fa_lengths(
        tmp_path, "block_table = block_table[:, : (max(kv_lens) + block_size - 1) // block_size]", "(max(kv_lens)")
    shaped = check(report, HOST_SHAPED)
    assert not shaped.passed and f"kvcache_attention.py:{line}" in shaped.detail, shaped.detail
    assert "actual_seq_lengths_list_kv" in shaped.detail
    assert check(report, "logits vs transformers").passed  # eager and CPU replay agree: only the shape is wrong


def test_write_slots_computed_from_the_host_lengths_are_named_at_their_line(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", exe_mode="npugraph_ex")
    # "the new token sits at kv_len - 1": right on every eager step and in the CPU trace, but a tensor made from the
    # host lengths inside the step is copied once by the device capture and replayed with those values
    mutate(rendered, r"(\n(\s+))self\.update_cache\(key_states, value_states, slot_mapping\)",
           r"\1if not forward_metadata.is_prefill:"
           r"\1    pos = torch.tensor(forward_metadata.actual_seq_lengths_list_kv, dtype=torch.int64) - 1"
           r"\1    block = block_table.long().gather(1, (pos // self.k_cache.shape[1]).unsqueeze(1)).squeeze(1)"
           r"\1    slot_mapping = block * self.k_cache.shape[1] + pos % self.k_cache.shape[1]"
           r"\1self.update_cache(key_states, value_states, slot_mapping)", count=1)
    line = _line_of(rendered / "kvcache_attention.py", "pos = torch.tensor(")
    report = run_validate(manifest, rendered, cfg)
    filled = check(report, HOST_SHAPED)
    assert not filled.passed and f"kvcache_attention.py:{line}" in filled.detail, filled.detail
    assert "values from" in filled.detail and "actual_seq_lengths_list_kv" in filled.detail
    assert check(report, "logits vs transformers").passed  # right numbers on CPU: only the capture would replay them


def test_padded_rows_pointed_at_a_live_row_instead_of_the_null_block_fail_by_name(tmp_path):
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", exe_mode="npugraph_ex", deploy_mode="standalone")
    # "pad with row 0": the padded rows write row 0's slot and read its blocks
    mutate(rendered, r"null_rows = torch\.full\(\(pad, self\.block_table\.shape\[1\]\), self\.null_block",
           "null_rows = self.block_table[:1].expand(pad, -1) + 0 * torch.full((pad, self.block_table.shape[1]), "
           "self.null_block", name="kvcache_runner.py")
    mutate(rendered, r"null_slots = \(self\.null_block \* BLOCK_SIZE", "null_slots = (0 * BLOCK_SIZE",
           name="kvcache_runner.py")
    report = run_validate(manifest, rendered, cfg)
    padding = check(report, PADDING)
    assert not padding.passed and "not the null block" in padding.detail, padding
    assert "kvcache_runner.py:" in padding.measured["runner"]
    assert not report.passed


def test_a_runner_block_table_cut_to_the_longest_request_recaptures_with_the_input_named(tmp_path):
    # the same mistake made by the runner, outside the step: the captured input's width follows the longest request,
    # so the capture's size guard fails when a request crosses a block boundary (the device graph would replay the
    # capture's width)
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", exe_mode="npugraph_ex", deploy_mode="standalone")
    mutate(rendered, r"block_table=torch\.cat\(\[self\.block_table\[index\], null_rows\]\),",
           "block_table=torch.cat([self.block_table[index], null_rows])"
           "[:, : int((kv_lens.max() + BLOCK_SIZE - 1) // BLOCK_SIZE)],", name="kvcache_runner.py")
    report = run_validate(manifest, rendered, cfg)
    again = check(report, NO_RECAPTURE)
    assert not again.passed and "'forward_metadata.block_table' size mismatch" in again.detail, again.detail
    assert "changed shape" in again.detail and "kvcache_attention.py:" in again.detail  # where the step reads it
    assert check(report, "logits vs transformers").passed  # eager numbers are right: only the replay would be wrong


def test_torch_npu_attention_in_a_ge_graph_decode_is_named_at_its_line(tmp_path):
    # ge_graph's decode FA called through torch_npu instead of torchair.ops: torch_npu takes host ints, the step hands
    # it the metadata's length tensors, read back on the host inside the static graph
    manifest, rendered, cfg = render_case(tmp_path, "qwen3_8b", exe_mode="ge_graph")
    mutate(rendered, r"fa_ops\(forward_metadata\)\.npu_fused_infer_attention_score", "torch_npu.npu_fused_infer_attention_score")
    line = _line_of(rendered / "kvcache_attention.py", "= torch_npu.npu_fused_infer_attention_score(")
    broken = check(run_validate(manifest, rendered, cfg), CAPTURE)
    assert not broken.passed and f"kvcache_attention.py:{line}" in broken.detail, broken.detail
    assert "a device tensor given for host ints: actual_seq_lengths=" in broken.detail
