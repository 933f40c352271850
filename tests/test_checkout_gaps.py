"""Gaps of kvcache in the real engine are said as such (issue 43): a package the model imports that this machine lacks
and kvcache stands in for nowhere (a vendor operator package) is exit 2 naming it, where it is imported and what the
model uses of it; never the model's runtime failure (V202, exit 1)."""

from __future__ import annotations

from pathlib import Path

from cli_support import invoke
from model_infer_kvcache.validators.checkout_run.support import package_uses
from shared_dirs import ROOT, shared_path

CONFIG = ROOT / "tests" / "fixtures" / "configs" / "qwen3_8b.json"
MODEL_FILE = Path("models") / "qwen" / "models" / "modeling_qwen.py"


def _edited_copy(tmp_path: Path) -> tuple[Path, int]:
    """modeling_qwen.py importing a vendor operator package and calling two of its ops (one through an alias)."""
    src = shared_path("upstream", "cann-recipes-infer") / MODEL_FILE
    lines = src.read_text(encoding="utf-8").splitlines()
    at = lines.index("import torch_npu") + 1
    lines[at:at] = ["import ascend_vendor_ops as avo", "from ascend_vendor_ops.fused import fused_rope"]
    lines.append("")
    lines.append("def _uses_vendor_ops(x):")
    lines.append("    return avo.npu_fused_swiglu(x) + fused_rope(x) + avo.npu_fused_swiglu(x)")
    out = tmp_path / "modeling_qwen.py"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out, at + 1


def test_a_vendor_package_the_machine_lacks_is_a_kvcache_gap(tmp_path, capsys):
    root = shared_path("upstream", "cann-recipes-infer")
    edited, line = _edited_copy(tmp_path)
    rc, out, err = invoke(["validate", "--framework-root", root, "--model", "qwen3_8b", "--config", CONFIG,
                           "--model-file", edited, "--no-sweep", "--report", tmp_path / "r.json"], capsys)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(lines) == 1, (rc, err[-1500:])
    msg = lines[0]
    assert "not supported by kvcache: package ascend_vendor_ops" in msg
    assert f"modeling_qwen.py:{line}" in msg  # where the model imports it
    assert "avo.npu_fused_swiglu" in msg and "ascend_vendor_ops.fused.fused_rope" in msg  # what it uses, statically
    assert "V202" not in out and not (tmp_path / "r.json").exists()  # no model failure reported, nothing written


def test_package_uses_are_read_statically(tmp_path):
    (tmp_path / "a.py").write_text("import vendor_ops\nimport torch\n"
                                   "y = vendor_ops.op_a(1)\nz = torch.ops.vendor_ops.op_b(2)\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("from vendor_ops.x import op_c, op_d as e\nimport other\nother.op_z()\n",
                                           encoding="utf-8")
    assert package_uses("vendor_ops", [tmp_path]) == {"vendor_ops.op_a", "torch.ops.vendor_ops.op_b",
                                                       "vendor_ops.x.op_c", "vendor_ops.x.op_d"}


def test_a_config_field_no_class_supplies_is_bad_input_naming_field_and_line(tmp_path, capsys):
    """The model reads a field neither the config.json nor the folder's own config class has: exit 2 naming the
    field and the model's file:line (was: V202, the model's runtime failure)."""
    src = shared_path("upstream", "cann-recipes-infer") / MODEL_FILE
    lines = src.read_text(encoding="utf-8").splitlines()
    at = next(i for i, x in enumerate(lines) if "self.use_qk_norm = getattr(config" in x)
    indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
    lines.insert(at, f"{indent}self.qk_clip = config.qk_clip_threshold")
    edited = tmp_path / "modeling_qwen.py"
    edited.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rc, out, err = invoke(["validate", "--framework-root", src.parents[3], "--model", "qwen3_8b", "--config", CONFIG,
                           "--model-file", edited, "--no-sweep"], capsys)
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(line) == 1 and "V202" not in out, (rc, err[-1500:])
    assert f"qwen3_8b.json: qk_clip_threshold: missing: modeling_qwen.py:{at + 1} reads config.qk_clip_threshold" \
        in line[0] and "Qwen3Config" in line[0], line[0]


class _Rope:
    """The shape of upstream DeepSeek's modules._init_rope: YaRN keys read from config.rope_scaling."""

    def __init__(self, config):
        self.config = config

    def init_rope(self):
        return {key: self.config.rope_scaling[key] for key in ["beta_fast", "mscale"] if key in self.config.rope_scaling}

    def other_none(self):
        table = None
        return self.config.rope_theta * len(table)


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the exception under test
        return exc
    raise AssertionError("did not raise")


def test_a_config_field_used_as_a_value_but_none_is_bad_input_naming_field_and_line():
    """transformers' DeepseekV3Config() has no rope_scaling (None); the upstream DeepSeek folder always builds a
    YaRN rotary embedding from it: exit 2 naming the field and the reading line, not the model's TypeError."""
    from model_infer_kvcache.validators.checkout_run.support import none_config_field
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.rope_scaling, config.rope_theta = None, 10000.0
    rope = _Rope(config)
    found = none_config_field(_raised(rope.init_rope), "cfg.json")
    line = next(i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1) if "if key in self.config.rope" in t)
    assert found is not None and found.field == "rope_scaling"
    assert found.message.startswith(f"test_checkout_gaps.py:{line} uses config.rope_scaling as a value, and it is None")
    # transformers 5 keeps an unscaled rope as {"rope_type": "default"}; the run read it the 4.x way (None), and
    # the check reads it so too after the run's scope is gone
    config.rope_scaling = None
    exc = _raised(rope.init_rope)
    config.rope_scaling = {"rope_type": "default", "rope_theta": 10000.0}
    assert none_config_field(exc, "cfg.json").field == "rope_scaling"
    # negative control: the failing line reads a config field that is set (rope_theta); the None is the model's own
    assert none_config_field(_raised(rope.other_none), "cfg.json") is None
