"""The layout a checkout's model is validated at (issue 43 step 3): the folder's served layouts, read from its
yamls, and the failures that only the world size causes, told apart from the model's other failures.

The end-to-end case (Qwen3-MoE left to kvcache runs at attention TP 2 because its code refuses one rank) is
tests/test_checkout_run.py::test_qwen3_moe_runs_at_attention_tp2_because_its_code_refuses_one_rank.
"""

from __future__ import annotations

import pytest
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.validators.checkout_run import layout
from model_infer_kvcache.validators.checkout_run.validate import CheckoutRequest, _refuse_both_layouts
from model_infer_kvcache.validators.pipeline.report import Report
from shared_dirs import upstream_head


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the exception under test, with its traceback
        return exc
    raise AssertionError("did not raise")


class _Moe:
    """The two shapes of a one-rank refusal upstream code shows (Qwen3-MoE / DeepSeek, bailing_2_5)."""

    hccl_comm_dict = None
    experts = None

    def ep_group(self):
        raise KeyError("Communication group 'moe_ep_group' not found. Available groups: ['default_pg']")

    def comm(self):
        return self.hccl_comm_dict.get("moe_ep_group")

    def unrelated_none(self):
        return self.experts.get("w1")  # a None the model forgot to build: the model's own bug at any world size

    def tp_check(self):
        assert 8 % 3 == 0, "num_key_value_heads must be divisible by attn_tp_size"

    def shape_check(self):
        assert 3 == 4, "q and k differ in shape"

    def other_sizes(self):
        raise ValueError("hidden_size must be divisible by 64 and step_size positive")


def test_a_group_registered_only_above_one_rank_is_a_one_rank_refusal():
    moe = _Moe()
    assert layout.rank_refusal(_raised(moe.ep_group), 1) == "the model registers that group only with more than one rank"
    assert "builds its communication groups only with more than one rank" in layout.rank_refusal(_raised(moe.comm), 1)
    # at two ranks the same errors are the model's (the group should exist there)
    assert layout.rank_refusal(_raised(moe.ep_group), 2) is None
    assert layout.rank_refusal(_raised(moe.comm), 2) is None


def test_the_models_other_failures_are_not_layout_refusals():
    moe = _Moe()
    assert layout.rank_refusal(_raised(moe.unrelated_none), 1) is None
    assert layout.rank_refusal(_raised(moe.shape_check), 1) is None
    assert layout.rank_refusal(_raised(moe.shape_check), 2) is None
    assert layout.rank_refusal(_raised(moe.other_sizes), 2) is None  # sizes, but no parallel size
    assert layout.rank_refusal(_raised(lambda: {}["moe_ep_group"]), 1) is None  # a KeyError not from the comm manager


def test_the_models_own_size_check_refuses_two_ranks():
    assert layout.rank_refusal(_raised(_Moe().tp_check), 2) == \
        "the model's own check of its parallel sizes refuses this layout"
    # LongCat-Flash's AFD FFN (ffn.py) at one rank: its own check names world_size
    afd = _raised(lambda: (_ for _ in ()).throw(ValueError(
        "AFD is only supported when world_size % 2 == 0, but now world_size=1.")))
    assert layout.rank_refusal(afd, 1) == "the model's own check of its parallel sizes refuses this layout"


def test_kvcache_chooses_the_layout_only_when_the_user_did_not():
    req = CheckoutRequest("root", "m", "c.json")
    assert layout.chosen_by_kvcache(req, 1)
    assert not layout.chosen_by_kvcache(CheckoutRequest("root", "m", "c.json", attn_tp_size=1), 1)
    assert not layout.chosen_by_kvcache(CheckoutRequest("root", "m", "c.json", manifest="m.json"), 1)
    assert not layout.chosen_by_kvcache(req, 2)  # a rank of a multi-rank run never re-chooses


def _report_failing(detail: str, link: str = "runtime") -> Report:
    report = Report(backend="emulated", deploy_mode="framework", model_type="x", manifest_hash="h")
    name = "checkout model runs in the engine without errors" if link == "runtime" else \
        "logits vs transformers max |diff| <= 0.0001"
    report.add(name, link, False, detail=detail)
    return report


def test_both_layouts_refused_is_kvcaches_gap_exit_2_naming_both_lines():
    refused = layout.RanksRefused("modeling_x.py:423: KeyError: 'moe_ep_group'", "the model registers that group "
                                  "only with more than one rank")
    report = _report_failing("modeling_x.py:88: AssertionError: attn_tp_size must be 1 (the folder serves attention DP)")
    with pytest.raises(InputError) as caught:
        _refuse_both_layouts(CheckoutRequest("root", "m", "c.json"), report, refused)
    assert caught.value.field == "--model"
    message = caught.value.message
    assert message.startswith("not supported by kvcache: no layout kvcache runs is accepted by the model")
    assert "modeling_x.py:423" in message and "modeling_x.py:88: AssertionError: attn_tp_size must be 1" in message


def test_a_two_rank_failure_that_is_no_size_check_stays_the_models():
    refused = layout.RanksRefused("modeling_x.py:423: KeyError: 'moe_ep_group'", "why")
    for report in (_report_failing("modeling_x.py:90: AssertionError: q and k differ in shape"),
                   _report_failing("first failure at step 3 request 1", link="numeric")):
        _refuse_both_layouts(CheckoutRequest("root", "m", "c.json"), report, refused)  # no exit 2


def test_served_layouts_read_nested_and_top_level_parallel_sizes(tmp_path):
    folder = tmp_path / "models" / "m" / "config"
    (folder / "pd").mkdir(parents=True)
    (folder / "a.yaml").write_text("parallel_config:\n  world_size: 16\n  attn_tp_size: 1\n  moe_tp_size: 1\n")
    (folder / "pd" / "b.yaml").write_text("world_size: 1\nparallel_config:\n  attn_tp_size: 1\n")
    (folder / "broken.yaml").write_text("parallel_config: [\n")
    (folder / "other.yaml").write_text("data_config:\n  batch_size: 4\n")
    served = layout.served_layouts(tmp_path, ["m"])
    assert [(s.yaml, s.world_size, s.attn_tp_size, s.moe_tp_size) for s in served] == [
        ("models/m/config/a.yaml", 16, 1, 1), ("models/m/config/pd/b.yaml", 1, 1, None)]
    assert layout.describe_served(served) == "its 2 yamls serve world_size 1/16, attn_tp_size 1, moe_tp_size 1"
    assert layout.describe_served([]) == "its folder has no yaml with a parallel_config"


def test_the_snapshots_qwen3_moe_yamls_serve_it_on_many_ranks_never_one():
    root = upstream_head()
    from model_infer_kvcache.validators.checkout_run.registry import model_folders

    assert model_folders(root, "kimi_k2") == ["deepseek_r1"]  # a registered key reusing another folder
    assert model_folders(root, "pangu_7b") == ["pangu_7b"]  # a folder no key registers
    served = layout.served_layouts(root, model_folders(root, "qwen3_moe"))
    assert served and all(s.world_size and s.world_size > 1 for s in served)
    assert {s.attn_tp_size for s in served} >= {1, 16}
