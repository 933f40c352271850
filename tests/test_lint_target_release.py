"""KV103 judges keywords against the torch-npu release a file's folder targets.

A keyword that one committed release has and another lacks (``out_dtype`` on FA v2: 2.14.0 has it,
2.9.0 does not) is right or wrong depending on the release the model folder installs, which its
README / requirements name. Each case is a tiny model folder of our making.
"""

from __future__ import annotations

import pytest
from model_infer_kvcache.analyzer.operators.schemas import RELEASES, releases_accepting
from model_infer_kvcache.validators.lint import lint_paths
from model_infer_kvcache.validators.lint.target_release import nearest_committed, target_for

CALL = '''import torch_npu


def attend(q, k, v, table):
    return torch_npu.npu_fused_infer_attention_score_v2(
        q, k, v, input_layout="TND", sparse_mode=3, block_table=table, block_size=128,
        out_dtype=1,
    )
'''


def _folder(tmp_path, readme: str | None, requirements: str | None = None):
    model = tmp_path / "models" / "m"
    (model / "models").mkdir(parents=True)
    (tmp_path / "executor").mkdir()
    if readme is not None:
        (model / "README.md").write_text(readme, encoding="utf-8")
    if requirements is not None:
        (model / "requirements.txt").write_text(requirements, encoding="utf-8")
    path = model / "models" / "modeling_m.py"
    path.write_text(CALL, encoding="utf-8")
    return path


def test_the_committed_releases_disagree_on_the_keyword():
    assert releases_accepting("npu_fused_infer_attention_score_v2", "out_dtype") == ("2.14.0",)
    assert set(RELEASES) == {"2.9.0", "2.14.0"}


@pytest.mark.parametrize("named, judged", [("2.7.1.post5", "2.9.0"), ("2.8.0.post4", "2.9.0"), ("2.9.0", "2.9.0"),
                                           ("2.11.0rc1", "2.9.0"), ("2.14.0", "2.14.0"), ("2.15.1", "2.14.0")])
def test_nearest_committed_release(named, judged):
    assert nearest_committed(named) == judged


def test_folder_targeting_an_older_release_is_reported_with_the_release_that_has_it(tmp_path):
    path = _folder(tmp_path, "安装 `torch_npu-2.8.0.post4-cp311-cp311-manylinux_2_28_${arch}.whl`\n")
    findings = lint_paths([path]).findings
    assert [f.rule for f in findings] == ["KV103"]
    assert "in torch_npu 2.9.0 (README.md targets torch_npu 2.8.0.post4)" in findings[0].message
    assert "exists in torch_npu 2.14.0" in findings[0].hint


def test_folder_targeting_the_newer_release_is_clean(tmp_path):
    path = _folder(tmp_path, None, requirements="torch==2.14.0\ntorch_npu==2.14.0\n")
    assert target_for(str(path)).release == "2.14.0"
    assert lint_paths([path]).findings == []


def test_ascend_product_numbering_is_not_a_release_and_no_name_means_the_newest(tmp_path):
    path = _folder(tmp_path, "本样例支持的 torch_npu 版本为 `v26.0.0`,PyTorch 版本为 `2.8.0`。\n")
    target = target_for(str(path))
    assert target.release == "2.14.0" and "no torch_npu release named" in target.why
    assert lint_paths([path]).findings == []


def test_the_command_line_choice_overrides_the_folder(tmp_path):
    path = _folder(tmp_path, None, requirements="torch_npu==2.14.0\n")
    assert [f.rule for f in lint_paths([path], torch_npu="2.9.0").findings] == ["KV103"]
    with pytest.raises(ValueError, match="no committed schemas"):
        lint_paths([path], torch_npu="3.0")


def test_a_keyword_no_release_has_is_reported_everywhere(tmp_path):
    path = _folder(tmp_path, None, requirements="torch_npu==2.14.0\n")
    path.write_text(CALL.replace("out_dtype=1", "softmax_lse=True"), encoding="utf-8")
    findings = lint_paths([path]).findings
    assert [f.rule for f in findings] == ["KV103"] and "in torch_npu 2.14.0" in findings[0].message
    assert "exists in torch_npu" not in findings[0].hint
