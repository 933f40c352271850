"""Localisation of a numeric failure at attention TP > 1 (issue 43): upstream qwen3_5 (Legacy) refuses one rank, so
kvcache runs it at attention TP 2 over two gloo ranks; its prefill of unequal prompts fails the logits, and the
report names the model file's line where the failure starts: ``torch.bucketize(token_idx, cu_seq_lens[1:],
right=False)`` in its gated-delta-net prefill gives the first token of every request but the first the previous
request's row. With equal prompts (``--uniform-prefill``), which that line maps right, the run passes and nothing
is localised.

Needs the snapshot (``KVCACHE_SHARED``; skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from shared_dirs import upstream_head

MODEL_FILE = "models/qwen3_5/models/modeling_qwen3_5_moe.py"
BUCKETIZE = "torch.bucketize(token_idx, cu_seq_lens[1:], right=False)"


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    import transformers

    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(transformers.Qwen3_5MoeTextConfig().to_dict(), default=str), encoding="utf-8")
    return path


def _validate(config: Path, **kw):
    from model_infer_kvcache.validators.checkout_run import CheckoutRequest, validate_checkout
    from model_infer_kvcache.validators.pipeline.request_stream import Scenario

    # One Legacy batch of four prompts, two past a 64-token chunk of the gated-delta prefill. Attention TP 2 named
    # here, as `kvcache validate` retries when one rank is refused (its MoE's expert-parallel group; the retry is
    # test_checkout_run's qwen3_moe case): the same ranks run, without the refused one-rank attempt's time.
    stream = Scenario(first=((120, 3), (40, 3), (90, 3)), late=((60, 3),), max_concurrency=3, release_requests=0)
    return validate_checkout(CheckoutRequest(str(upstream_head()), "qwen3.5", str(config), scenario=stream,
                                             attn_tp_size=2, oracle="transformers", sweep_readings=False, **kw))


def _bucketize_lines(text: str) -> dict[str, int]:
    """function name -> 1-based line of the ``right=False`` bucketize in it (the prefill paths that have one)."""
    out, func = {}, None
    for n, line in enumerate(text.splitlines(), 1):
        found = re.match(r"\s*def (\w+)\(", line)
        func = found.group(1) if found else func
        if BUCKETIZE in line:
            out[func] = n
    return out


@pytest.mark.slow
def test_qwen3_5_at_attention_tp_2_names_the_bucketize_line(config):
    report = _validate(config)
    assert report.provenance["layout"]["attn_tp_size"] == 2
    logits = next(c for c in report.checks if c.id == "V301")
    assert not logits.passed and "first failure at step 0" in logits.detail, logits.detail
    loc = report.localisation
    assert (loc["step"], loc["layer"], loc["submodule"]) == (0, 0, "attention output"), loc
    lines = _bucketize_lines((upstream_head() / MODEL_FILE).read_text(encoding="utf-8"))
    assert lines, f"{BUCKETIZE} is no longer in {MODEL_FILE}"
    named = [f"modeling_qwen3_5_moe.py:{n} ({func})" for func, n in lines.items()]
    assert len(loc["where"]) == 1 and loc["where"][0] in named, (loc["where"], named)
    first = loc["calls"][0]
    assert first["op"] == "torch.bucketize" and first["at"] == loc["where"][0]
    assert "request index it gives each packed token is wrong at request boundaries" in first["finding"]
    assert f"look at {loc['where'][0]} torch.bucketize" in loc["headline"]
    # reported as single-rank localisation is: first in the Markdown and the JSON, and the TP said in a note
    top = report.to_markdown().splitlines()[2]
    assert top.startswith("- **定位(首个偏离)**") and loc["where"][0] in top, top
    assert list(json.loads(report.to_json()))[:2] == ["passed", "localisation"]
    assert any(n.startswith("localisation at attention TP 2: rank 0's replay") for n in report.notes), report.notes


@pytest.mark.slow
def test_qwen3_5_with_equal_prompts_passes_and_localises_nothing(config):
    report = _validate(config, uniform_prefill=True)
    assert report.passed, [(c.name, c.detail) for c in report.failed()]
    assert report.provenance["layout"]["attn_tp_size"] == 2
    assert report.localisation == {} and "localisation" not in report.to_dict()
    assert not any("locali" in n for n in report.notes), report.notes


def test_packing_check_names_a_map_wrong_only_at_request_boundaries():
    """The check behind the named line, without the snapshot: the bucketize of ``cu_seq_lens[1:]`` with
    right=False is wrong at each request's first token; right=True, the positions it gives and a plain arange
    (another map) are not findings."""
    import torch
    from model_infer_kvcache.validators.pipeline.localise import packing_finding

    lens = [5, 3, 4]
    requests = [k for k, n in enumerate(lens) for _ in range(n)]
    positions = [p for n in lens for p in range(n)]
    cu = torch.tensor([0, 5, 8, 12])
    token = torch.arange(12)
    wrong = torch.bucketize(token, cu[1:], right=False).tolist()
    finding = packing_finding(wrong, requests, positions)
    assert finding.startswith("the request index it gives each packed token is wrong at request boundaries: row(s) "
                              "5 (the first token of request 1), 8 (the first token of request 2) get 0, 1 instead "
                              "of 1, 2; its other 10 rows agree"), finding
    right = torch.bucketize(token, cu[1:], right=True)
    assert right.tolist() == requests and packing_finding(right.tolist(), requests, positions) is None
    assert packing_finding((token - cu[right]).tolist(), requests, positions) is None
    assert packing_finding(token.tolist(), requests, positions) is None
    assert packing_finding([0, 0, 1], [0, 1, 2], [0, 0, 0]) is None  # one-token requests: every row a boundary
