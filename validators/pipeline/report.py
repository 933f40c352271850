"""Validation report: checks with measured values, as JSON (machines) and Markdown (progress.md)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from model_infer_kvcache.validators.pipeline.check_ids import check_def

Link = Literal["init", "runtime", "numeric", "release"]
SECTION_ID = "validate"


@dataclass
class Check:
    name: str
    link: Link
    passed: bool
    measured: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    id: str = ""  # the registered check's stable ID (check_ids.CHECKS), set by Report.add


@dataclass
class Report:
    backend: str
    deploy_mode: str
    model_type: str
    manifest_hash: str
    dtype: str = "float32"  # compute dtype of the model under test
    tolerance: float = 1e-4  # logit tolerance of that dtype
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    readings: dict[str, str] = field(default_factory=dict)
    # Operator questions (switches) whose reading decided some call of this run
    # (``validators.npu_ops.consulted_questions``): the checkout mode sweeps them.
    consulted: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # Where the code under test came from (checkout path/commit, API generation, model file, which
    # modules are the checkout's and which stand-ins); empty when the run has nothing to declare.
    provenance: dict[str, Any] = field(default_factory=dict)
    # Where a numeric failure starts (``localise.localise``: first diverging layer, sub-module, the operator
    # calls with file:line); empty when the run passed numerically or was not localised.
    localisation: dict[str, Any] = field(default_factory=dict)
    # The numeric link's first failing chunk (step, request, rows, positions, tokens): what localisation
    # replays; never written out.
    first_failure: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def fresh(self, **changes) -> Report:
        """An empty report of the same run (model, manifest, backend, dtype): for a rerun's own checks."""
        return Report(**{"backend": self.backend, "deploy_mode": self.deploy_mode, "model_type": self.model_type,
                         "manifest_hash": self.manifest_hash, "dtype": self.dtype, "tolerance": self.tolerance,
                         **changes})

    def add(self, name: str, link: Link, passed: bool, detail: str = "", **measured) -> Check:
        # an unregistered name raises: every reported check carries its registered ID
        check = Check(name, link, bool(passed), _plain(measured), detail, check_def(link, name).id)
        self.checks.append(check)
        return check

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            **({"localisation": self.localisation} if self.localisation else {}),
            "backend": self.backend,
            "deploy_mode": self.deploy_mode,
            "model_type": self.model_type,
            "manifest_hash": self.manifest_hash,
            "dtype": self.dtype,
            "tolerance": self.tolerance,
            "readings": self.readings,
            **({"consulted": self.consulted} if self.consulted else {}),
            "seconds": round(self.seconds, 2),
            "notes": self.notes,
            "checks": [asdict(c) for c in self.checks],
            **({"provenance": self.provenance} if self.provenance else {}),
        }

    def _host(self) -> str:
        """What ran the code under test besides the emulated operators (for the report's first line)."""
        if "ours" in self.provenance:  # checkout mode: the checkout's engine, scheduler and model file
            return "检出的真实框架与模型文件"
        return "框架契约 harness"

    def to_json(self) -> str:
        """Strict JSON: a non-finite measurement (a NaN logit's diff, an inf bound) is written as the string
        "inf" / "-inf" / "nan", never as the bare Infinity / NaN that JSON parsers other than Python's refuse."""
        return json.dumps(_finite(self.to_dict()), indent=2, ensure_ascii=False, allow_nan=False) + "\n"

    def to_markdown(self) -> str:
        verdict = "通过" if self.passed else "未通过"
        lines = [
            "### 自验证结果",
            "",
            *_localisation_lines(self.localisation),
            f"- 模型: `{self.model_type}`,部署模式: {self.deploy_mode},后端: **{self.backend}**"
            + (f" (CPU 仿真算子 + {self._host()})" if self.backend == "emulated" else "")
            + f",计算精度: {self.dtype}(logits 容差 {self.tolerance:g})",
            f"- manifest hash: `{self.manifest_hash}`,结论: **{verdict}**"
            f"({sum(c.passed for c in self.checks)}/{len(self.checks)} 项通过,用时 {self.seconds:.1f}s)",
        ]
        if self.readings:
            lines.append("- 设备行为读法: " + ", ".join(f"{k}={v}" for k, v in self.readings.items()))
        if self.consulted:
            lines.append("- 本次运行中结果取决于读法的算子问题: " + ", ".join(self.consulted))
        lines += ["", "| ID | 链路 | 检查项 | 结果 | 实测 |", "|---|---|---|---|---|"]
        for c in self.checks:
            shown = ", ".join(f"{k}={_short(v)}" for k, v in c.measured.items())
            if c.detail:
                shown = f"{shown}; {c.detail}" if shown else c.detail
            lines.append(f"| {c.id} | {c.link} | {c.name} | {'✅' if c.passed else '❌'} | {shown.replace('|', '/')} |")
        if self.notes:
            lines += ["", "说明:", ""] + [f"- {n}" for n in self.notes]
        if self.provenance:
            lines += ["", "来源 (provenance):", ""] + [f"- {k}: {_listed(v)}" for k, v in self.provenance.items()]
        return "\n".join(lines) + "\n"


LAYER_OUTPUT = "layer output"  # a layer judged as a whole (its attention sublayers in one ModuleList: localise.py)
SUBMODULE_LABELS = {"attention input": "注意力输入", "cache write": "缓存写入", "attention output": "注意力输出",
                    "MLP": "MLP", LAYER_OUTPUT: "整层输出"}


def _localisation_lines(loc: dict) -> list[str]:
    """Where a numeric failure starts, first in the report: the layer and sub-module, then its calls."""
    if not loc:
        return []
    head = f"- **定位(首个偏离)**: step {loc.get('step')} request {loc.get('request')}"
    if loc.get("submodule"):
        head += f",第 {loc['layer']} 层,子模块 {loc['submodule']}({SUBMODULE_LABELS.get(loc['submodule'], '')})"
    lines = [f"{head} — {loc.get('headline', '')}"]
    for c in loc.get("calls", []):
        lines.append(f"  - `{c['at']}` {c['op']}" + (f" ({c['cache']})" if c.get("cache") else "")
                     + (f": {c['finding']}" if c.get("finding") else ""))
    return lines


def _listed(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "; ".join(str(v) for v in value) if value else "(none)"
    return str(value)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        if hasattr(v, "tolist"):
            v = v.tolist()
        elif isinstance(v, (set, frozenset, tuple)):
            v = sorted(v) if isinstance(v, (set, frozenset)) else list(v)
        out[k] = v
    return out
