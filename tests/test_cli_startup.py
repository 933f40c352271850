"""The commands an agent calls most answer fast: `--help` never imports torch or transformers, and
`kvcache analyze` keeps what transformers reports for its cross-check in a user cache that never changes
the answer (same manifest as a cold run; a corrupt, foreign or unwritable cache is ignored).

The timings themselves are in benchmarks/bench_cli_startup.py (ratios measured in one run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer import arch_check, rules
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
EXAMPLE = ROOT / "examples" / "tiny_qwen3" / "config.json"
COMMANDS = ("analyze", "schema", "render", "lint", "validate", "run", "probe")
HEAVY = ("torch", "transformers")

# Runs one `kvcache` command in this interpreter and prints which heavy modules it imported.
_PROBE = """
import json, sys
from model_infer_kvcache.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
print("\\n" + json.dumps({"code": code, "imported": [m for m in HEAVY if m in sys.modules]}), file=sys.stderr)
""".replace("HEAVY", repr(HEAVY))


def _run(args: list[str], cache: Path | str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, arch_check.CACHE_ENV: str(cache)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc, json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("command", COMMANDS)
def test_help_imports_neither_torch_nor_transformers(command, tmp_path):
    proc, seen = _run([command, "--help"], tmp_path)
    assert seen["code"] == 0 and "usage: kvcache" in proc.stdout
    assert seen["imported"] == [], f"`kvcache {command} --help` imported {seen['imported']}"


def test_warm_analyze_skips_transformers_and_writes_the_cold_manifest(tmp_path):
    args = ["analyze", "--config", str(EXAMPLE), "--dispatch", "部署模式：框架部署"]
    off, seen_off = _run(args, "")  # cache turned off: the cross-check built live
    cold, seen_cold = _run(args, tmp_path)
    warm, seen_warm = _run(args, tmp_path)
    assert seen_off["code"] == seen_cold["code"] == seen_warm["code"] == 0
    assert "transformers" in seen_cold["imported"] and "transformers" in seen_off["imported"]
    assert seen_warm["imported"] == [], "a warm cache must spare torch and transformers"
    assert off.stdout == cold.stdout == warm.stdout
    assert len(list((tmp_path / arch_check.CACHE_SUBDIR).glob("*.json"))) == 1


# ---------------------------------------------------------------- the cache in-process


def _qwen3(**kw):
    return analyze(AnalyzeRequest(config=str(CONFIGS / "qwen3_8b.json"), **kw))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder, and a count of the live builds (what a warm cache spares)."""
    monkeypatch.setenv(arch_check.CACHE_ENV, str(tmp_path))
    live = arch_check._live_report
    calls = []

    def counted(hf_type, section_json):
        calls.append(hf_type)
        return live(hf_type, section_json)

    monkeypatch.setattr(arch_check, "_live_report", counted)
    return tmp_path / arch_check.CACHE_SUBDIR, calls


def _entry(folder: Path) -> Path:
    (entry,) = folder.glob("*.json")
    return entry


def test_cache_hit_gives_the_same_manifest_without_a_live_build(cache):
    folder, calls = cache
    cold = _qwen3()
    assert calls == ["qwen3"]
    assert _qwen3() == cold and calls == ["qwen3"]  # served from the entry


def test_corrupt_entry_is_ignored_and_replaced(cache):
    folder, calls = cache
    cold = _qwen3()
    entry = _entry(folder)
    good = entry.read_text(encoding="utf-8")
    for damaged in ("{not json", good[: len(good) // 2], "[]", json.dumps({"key": 1})):
        entry.write_text(damaged, encoding="utf-8")
        assert _qwen3() == cold
        assert entry.read_text(encoding="utf-8") == good  # rebuilt and stored again
    assert calls == ["qwen3"] * 5


def test_tampered_entry_cannot_change_the_answer(cache):
    """An entry whose recorded scale no longer matches its checksum is not trusted: had it been, the
    cross-check would refuse the (right) manifest with a scale error."""
    folder, calls = cache
    cold = _qwen3()
    entry = _entry(folder)
    data = json.loads(entry.read_text(encoding="utf-8"))
    assert data["report"]["attentions"][0][2] == pytest.approx(128 ** -0.5)
    for row in data["report"]["attentions"]:
        row[2] = 1.0
    entry.write_text(json.dumps(data), encoding="utf-8")
    assert _qwen3() == cold and len(calls) == 2
    # The same tampering with the checksum recomputed is read: the check then compares against it.
    data["sha256"] = arch_check._digest(data["report"])
    entry.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(InputError, match="softmax scale"):
        _qwen3()


def test_entry_of_another_key_is_not_read(cache):
    """An entry moved under another key's name (another transformers, another config) is ignored."""
    folder, calls = cache
    _qwen3()
    entry = _entry(folder)
    config = json.loads((CONFIGS / "qwen3_8b.json").read_text(encoding="utf-8"))
    config["head_dim"] = 64  # an attention field: another key
    other = folder.parent / "other.json"
    other.write_text(json.dumps(config), encoding="utf-8")
    hf_type, section = arch_check._arch_key(config, "qwen3")
    key = {"format": arch_check._CACHE_FORMAT, **arch_check._installed_identity(), "model_type": hf_type,
           "config": section}
    entry.rename(arch_check._entry_path(key))
    m = analyze(AnalyzeRequest(config=str(other)))
    assert calls == ["qwen3", "qwen3"]
    assert m.fa.softmax_scale == pytest.approx(64 ** -0.5)


def test_unwritable_cache_changes_nothing(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder", encoding="utf-8")
    monkeypatch.setenv(arch_check.CACHE_ENV, str(blocker / "cache"))
    first = _qwen3()
    assert _qwen3() == first and blocker.read_text(encoding="utf-8") == "not a folder"
    assert not list(tmp_path.glob("**/.*.tmp"))


def test_warm_cache_still_catches_a_wrong_scale_rule(cache, monkeypatch):
    """The cache keeps what transformers reports, not the verdict: a wrong analyzer rule is still refused."""
    folder, calls = cache
    _qwen3()
    monkeypatch.setattr(rules, "decide_scale", lambda facts: (1.0, "deliberately wrong"))
    with pytest.raises(InputError, match="softmax scale: analyzer 1 .* vs transformers 0.0883883476"):
        _qwen3()
    assert calls == ["qwen3"]  # answered from the cache


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(arch_check.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert arch_check.cache_dir() == tmp_path / "model-infer-kvcache"
    monkeypatch.setenv(arch_check.CACHE_ENV, str(tmp_path / "mine"))
    assert arch_check.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(arch_check.CACHE_ENV, "")
    assert arch_check.cache_dir() is None
