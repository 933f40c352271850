"""`kvcache lint` / `python -m model_infer_kvcache.validators lint`: output formats, exit codes, suppression, selection."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import model_infer_kvcache.validators.__main__ as validators_main
import pytest
from model_infer_kvcache.analyzer.manifest import SCHEMA_VERSION
from model_infer_kvcache.validators.lint import RULES, lint_paths, lint_source
from model_infer_kvcache.validators.lint.cli import main as lint_main

from model_infer_kvcache import cli as kvcache_cli

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "lint"
BAD_201 = FIXTURES / "kv201_prefill_no_mask_bad.py"
GOOD_201 = FIXTURES / "kv201_prefill_no_mask_good.py"
BAD_101 = FIXTURES / "kv101_v1_name_on_v2_bad.py"
TEXT_LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+):(?P<col>\d+): (?P<rule>KV\d{3}) (?P<rest>.+\))$")

PREFILL_NO_MASK = """\
import torch_npu


class Attn:
    def forward(self, q, k, v, forward_metadata):
        if forward_metadata.is_prefill:
            return torch_npu.npu_fused_infer_attention_score(
                q, k, v, num_heads=8, scale=0.1, input_layout="TND", sparse_mode=0{suffix}
            )
        return None
"""


def _run(argv, capsys):
    code = lint_main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_text_format_and_exit_1(capsys):
    code, out, _ = _run([str(BAD_201)], capsys)
    assert code == 1
    lines = out.strip().splitlines()
    assert len(lines) == 1
    match = TEXT_LINE.match(lines[0])
    assert match, lines[0]
    assert match["path"] == str(BAD_201) and match["rule"] == "KV201"
    assert int(match["line"]) == 55 and int(match["col"]) >= 1
    finding = lint_paths([BAD_201]).findings[0]
    assert match["rest"] == f"{finding.message} ({finding.hint})"
    assert finding.hint == RULES["KV201"].hint and "sparse_mode=3" in finding.hint


def test_json_format(capsys):
    code, out, _ = _run([str(BAD_101), "--format", "json"], capsys)
    assert code == 1
    data = json.loads(out)
    assert isinstance(data, list) and len(data) == 2
    for item in data:
        assert set(item) >= {"rule", "path", "line", "col", "message", "hint"}
        assert item["rule"] == "KV101" and item["path"] == str(BAD_101)
    assert sorted(item["line"] for item in data) == [23, 26]


def test_clean_exit_0_and_json_empty_list(capsys):
    code, out, err = _run([str(GOOD_201)], capsys)
    assert (code, out) == (0, "")
    assert "1 file(s) clean" in err
    code, out, _ = _run([str(GOOD_201), "--format", "json"], capsys)
    assert code == 0 and json.loads(out) == []


def test_syntax_error_exit_2_other_files_still_linted(tmp_path, capsys):
    broken = tmp_path / "modeling_broken.py"
    broken.write_text("class Attn(nn.Module:\n    pass\n", encoding="utf-8")
    shutil.copy(BAD_201, tmp_path / "modeling_bad.py")
    shutil.copy(GOOD_201, tmp_path / "modeling_good.py")
    code, out, err = _run([str(tmp_path)], capsys)
    assert code == 2
    assert str(broken) in err and "syntax error" in err
    assert f"{tmp_path / 'modeling_bad.py'}:55:" in out  # the other files were linted
    report = lint_paths([tmp_path])
    assert [e.path for e in report.errors] == [str(broken)]
    assert report.errors[0].line == 1
    assert sorted(Path(f).name for f in report.files) == ["modeling_bad.py", "modeling_good.py"]


def test_unreadable_and_missing_paths_exit_2(tmp_path, capsys):
    latin = tmp_path / "latin1.py"
    latin.write_bytes("x = 'caf\xe9'\n".encode("latin-1"))
    missing = tmp_path / "nope.py"
    code, _, err = _run([str(latin), str(missing), str(GOOD_201)], capsys)
    assert code == 2
    assert str(latin) in err and str(missing) in err


def test_no_paths_is_usage_error(capsys):
    code, _, err = _run([], capsys)
    assert code == 2 and "PATH" in err


def test_bad_manifest_exit_2_naming_it(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    code, out, err = _run([str(GOOD_201), "--manifest", str(missing)], capsys)
    assert code == 2 and str(missing) in err and out == ""
    invalid = tmp_path / "invalid.json"
    invalid.write_text(f'{{"schema_version": "{SCHEMA_VERSION}"}}', encoding="utf-8")
    code, _, err = _run([str(GOOD_201), "--manifest", str(invalid)], capsys)
    assert code == 2 and str(invalid) in err and "not a valid selection manifest" in err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json", encoding="utf-8")
    code, _, err = _run([str(GOOD_201), "--manifest", str(garbage)], capsys)
    assert code == 2 and str(garbage) in err


def test_select_and_ignore(capsys):
    code, out, _ = _run([str(BAD_201), str(BAD_101), "--select", "KV101"], capsys)
    assert code == 1 and {TEXT_LINE.match(line)["rule"] for line in out.splitlines()} == {"KV101"}
    code, out, _ = _run([str(BAD_201), str(BAD_101), "--ignore", "kv101, KV201"], capsys)
    assert (code, out) == (0, "")


@pytest.mark.parametrize("flag", ["--select", "--ignore"])
def test_unknown_rule_ids_exit_2(flag, capsys):
    code, _, err = _run([str(BAD_201), flag, "KV101,KV999"], capsys)
    assert code == 2 and "KV999" in err


def test_suppression_comment_per_line():
    assert [f.rule for f in lint_source(PREFILL_NO_MASK.format(suffix=""))] == ["KV201"]
    assert lint_source(PREFILL_NO_MASK.format(suffix=",  # kvcache: ignore[KV201]")) == []
    assert lint_source(PREFILL_NO_MASK.format(suffix=",  # kvcache: ignore[KV101, KV201]")) == []
    # another rule's ID does not silence this one
    silenced_other = lint_source(PREFILL_NO_MASK.format(suffix=",  # kvcache: ignore[KV204]"))
    assert [f.rule for f in silenced_other] == ["KV201"]


def test_suppression_on_first_line_of_statement():
    source = PREFILL_NO_MASK.format(suffix="").replace(
        "            return torch_npu.npu_fused_infer_attention_score(",
        "            return torch_npu.npu_fused_infer_attention_score(  # kvcache: ignore[KV201]",
    )
    assert lint_source(source) == []


def test_list_rules_names_every_rule(capsys):
    code, out, _ = _run(["--list-rules"], capsys)
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == list(RULES)
    code, out, _ = _run(["--list-rules", "--format", "json"], capsys)
    rows = json.loads(out)
    assert [row["id"] for row in rows] == list(RULES)
    assert all(row["hint"] and row["message"] and row["title"] for row in rows)
    assert {row["id"] for row in rows if row["needs_manifest"]} == {i for i in RULES if i.startswith("KV8")}


def test_registry_ids_are_stable_and_unique():
    assert all(re.fullmatch(r"KV[1-9]\d\d", rule_id) for rule_id in RULES)
    assert len({rule.name for rule in RULES.values()}) == len(RULES)
    assert list(RULES) == sorted(RULES)


def test_kvcache_entry_point_routes_to_lint(capsys):
    assert kvcache_cli.main(["lint", str(BAD_201)]) == 1
    assert "KV201" in capsys.readouterr().out


def test_python_dash_m_validators_lint():
    proc = subprocess.run([sys.executable, "-m", "model_infer_kvcache.validators", "lint", str(BAD_201), "--format", "json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert [item["rule"] for item in json.loads(proc.stdout)] == ["KV201"]


def test_validators_main_routes_validate_with_its_own_arguments(monkeypatch):
    seen = {}
    fake = types.ModuleType("model_infer_kvcache.validators.cli")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "model_infer_kvcache.validators.cli", fake)
    assert validators_main.main(["validate", "--manifest", "m.json"]) == 0
    assert seen["argv"] == ["--manifest", "m.json"]  # the subcommand name is consumed, not passed on


@pytest.mark.parametrize("argv", [[], ["--manifest", "m.json"], ["lnit"]])
def test_validators_main_refuses_a_missing_or_unknown_command(monkeypatch, capsys, argv):
    """No implicit `validate`: whatever is not a known subcommand is one line, exit 2, and runs nothing."""
    fake = types.ModuleType("model_infer_kvcache.validators.cli")
    fake.main = lambda argv: pytest.fail("validate must not run")
    monkeypatch.setitem(sys.modules, "model_infer_kvcache.validators.cli", fake)
    assert validators_main.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: python -m model_infer_kvcache.validators: ")
    assert "lint, validate, probe" in err


def test_readme_rule_table_matches_registry():
    readme = (ROOT / "validators" / "lint" / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (KV\d{3}) \| (.+?) \| (yes)? ?\|$", readme, flags=re.MULTILINE)
    assert [(i, title, bool(m)) for i, title, m in rows] == [
        (r.id, r.title, r.needs_manifest) for r in RULES.values()
    ]


def test_lint_reads_real_schemas_without_importing_torch():
    """KV103 uses the committed torch_npu schemas; loading them must not pull in torch (speed)."""
    code = (
        "import sys; from model_infer_kvcache.validators.lint import lint_paths, ops; "
        f"r = lint_paths([{str(FIXTURES / 'kv103_unknown_keyword_bad.py')!r}]); "
        "print(sorted({f.rule for f in r.findings}), ops.schemas_available(), 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['KV103'] True False"
