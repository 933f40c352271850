"""references/emulated_ops.md lists exactly the emulated operators, and its survey of the upstream
models' operator calls stays true to the snapshot (when present) and to the registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.operators.schemas import EMULATED_OPS
from model_infer_kvcache.validators.npu_ops import emulated
from model_infer_kvcache.validators.npu_ops.errors import UnemulatedOperatorError
from shared_dirs import upstream_head

DOC = Path(__file__).resolve().parent.parent / "references" / "emulated_ops.md"


def _section(title: str) -> str:
    text = DOC.read_text("utf-8")
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _rows(title: str) -> list[list[str]]:
    rows = []
    for line in _section(title).splitlines():
        if line.startswith("| `"):
            rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    return rows


def test_table_lists_every_emulated_op_and_nothing_else():
    listed = [row[0] for row in _rows("已仿真的算子")]
    assert len(listed) == len(set(listed))
    assert set(listed) == set(emulated.OPS) == set(EMULATED_OPS)


def test_every_listed_module_implements_the_op():
    import importlib
    import inspect

    for op, module, *_ in _rows("已仿真的算子"):
        mod = importlib.import_module(f"model_infer_kvcache.validators.npu_ops.{module}")
        fn = emulated.OPS[op]
        if fn.__module__ == mod.__name__:
            continue
        # thin wrappers in emulated.py: they must call into the listed module
        source = inspect.getsource(fn)
        public = [name for name, value in vars(mod).items() if callable(value) and getattr(value, "__module__", "")
                  == mod.__name__]
        assert fn.__module__ == emulated.__name__ and (f"{module}." in source or any(
            re.search(rf"\b{name}\(", source) for name in public)), (op, module)


SURVEY = _rows("上游模型在 eager 非量化路径上调用的算子")


def test_survey_status_agrees_with_the_registry():
    assert SURVEY
    for location, op, _when, status in SURVEY:
        assert status in ("已仿真", "不在路径上"), location
        assert (op in emulated.OPS) == (status == "已仿真"), (location, op, status)


@pytest.mark.parametrize("location, op", [(row[0], row[1]) for row in SURVEY], ids=[row[0] for row in SURVEY])
def test_survey_lines_call_the_op_in_the_snapshot(location, op):
    path, line = location.rsplit(":", 1)
    source = (upstream_head() / path).read_text("utf-8").splitlines()
    assert re.search(rf"\b{re.escape(op)}\b", source[int(line) - 1]), source[int(line) - 1]


def test_not_emulated_message_points_here():
    message = str(UnemulatedOperatorError("torch_npu.npu_x", "models/a.py:1"))
    assert "references/emulated_ops.md" in message and DOC.is_file()
