"""`kvcache validate --framework-root ROOT --all`: every model of a checkout, one line each.

The models are the keys of the checkout's ``executor/core/support_models.py`` and the directories under
``models/`` no key registers (a standalone folder). Each runs as ``kvcache validate --model NAME`` would, in
its own process (a checkout's imports, a crash or a hang stay inside it), with a config.json from
``--config DIR/NAME.json`` when the user has one, else transformers' own config class of the model's type at its
defaults (the published architecture). One row per model: passed, failed (the first failing check, with its
file:line), refused (the one exit-2 line: what kvcache or the inputs lack), not in the checkout (a registered key
whose folder the checkout does not carry), or an internal error (exit 3: kvcache's own bug, never expected).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.files import atomic_write_text
from model_infer_kvcache.validators.checkout_run.registry import _spec_modules, model_folders

OUTCOMES = ("passed", "failed", "refused", "absent", "internal")
# Token ids a saved config.json carries and some config classes leave None at their defaults (HYV3Config): a
# checkout's embedding compares its padding_idx with ints. Filled only where the class has None.
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


@dataclass
class Row:
    model: str
    outcome: str  # one of OUTCOMES
    detail: str  # the first failing check, the exit-2 line, or the layout of a pass
    config: str  # where the config.json came from
    seconds: float = 0.0
    exit_code: int | None = None


def checkout_models(root: Path) -> list[str]:
    """Registered keys (in the registry's order), then the model directories under models/ no key uses."""
    specs = _spec_modules(root)
    used = {m.split(".")[1] for mods in specs.values() for m in mods if m.count(".") >= 2}
    folders = sorted(p.parent.name for p in (root / "models").glob("*/models") if p.is_dir())
    return list(specs) + [f for f in folders if f not in used]


def _declared_types(root: Path, name: str) -> tuple[str | None, list[str]]:
    """(the model_type of NAME's registered config class, every model_type its folder's config files declare),
    read statically: the checkout is not imported here."""
    specs = _spec_modules(root).get(name, [])
    folders = model_folders(root, name)
    config_class = None
    source = (root / "executor" / "core" / "support_models.py")
    if specs and source.is_file():  # the registry's (module, class) pairs: the config class is the last
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.List) \
                            and value.elts and isinstance(value.elts[-1], ast.Tuple):
                        config_class = getattr(value.elts[-1].elts[-1], "value", None)
    own, every = None, []
    for folder in folders:
        for path in sorted((root / "models" / folder / "models").glob("configuration_*.py")):
            for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(cls, ast.ClassDef):
                    continue
                for stmt in cls.body:
                    if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == "model_type"
                                                            for t in stmt.targets) \
                            and isinstance(stmt.value, ast.Constant):
                        every.append(stmt.value.value)
                        if cls.name == config_class:
                            own = stmt.value.value
    return own, every


def model_type_for(root: Path, name: str) -> str | None:
    """The transformers model type whose config stands for NAME: NAME itself when transformers knows it
    (deepseek_v4, whose folder reuses DeepseekV3Config's model_type), else the registered config class's, else the
    folder's (a text model_type first: the folder's ForCausalLM is the text model)."""
    from transformers import CONFIG_MAPPING

    if name in CONFIG_MAPPING:
        return name
    own, every = _declared_types(root, name)
    candidates = ([own] if own else []) + sorted(every, key=lambda t: not t.endswith("_text"))
    return next((t for t in candidates if t in CONFIG_MAPPING), candidates[0] if candidates else None)


def config_for(root: Path, name: str, config_dir: Path | None, tmp: Path) -> tuple[Path | None, str]:
    """(config.json path, where it came from); path None when there is none (the reason in the second item)."""
    if config_dir is not None and (config_dir / f"{name}.json").is_file():
        return config_dir / f"{name}.json", f"--configs {name}.json"
    model_type = model_type_for(root, name)
    from transformers import CONFIG_MAPPING

    if model_type is None or model_type not in CONFIG_MAPPING:
        runners = sorted(p.name for folder in model_folders(root, name) for p in (root / "models" / folder).glob("runner*.py"))
        if runners:  # the runner owns the caches: no framework-mode reference or config to run it against
            return None, (f"not supported by kvcache: a standalone folder (its own {', '.join(runners)}); "
                          f"transformers has no class for model_type {model_type!r}, so there is no reference to "
                          "compare with (and no config class to take defaults from)")
        what = f"model_type {model_type!r}" if model_type else "its config class (which declares no model_type)"
        return None, (f"no config: transformers has no config class for {what} to take defaults from: give "
                      f"--configs DIR with {name}.json (the model's published config.json)")
    cls = CONFIG_MAPPING[model_type]
    data = cls().to_dict()
    filled = [k for k, v in TOKEN_IDS.items() if data.get(k, 0) is None]
    data.update({k: TOKEN_IDS[k] for k in filled})
    path = tmp / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.json"
    atomic_write_text(path, json.dumps(data, default=str))
    return path, f"transformers {cls.__name__}() defaults" + (f" (+ {', '.join(filled)})" if filled else "")


def _standalone(root: Path, name: str) -> bool:
    """A model folder with a runner of its own (``runner_*.py``): `validate --runner-root` drives it."""
    return any((root / "models" / name).glob("runner*.py"))


def _outcome(rc: int, stderr: str, report: dict | None) -> tuple[str, str]:
    lines = stderr.splitlines()
    if rc == 0 and (report or {}).get("deploy_mode") == "standalone":
        return "passed", "standalone: its own runner, judged by the recompute oracle (--runner-root)"
    if rc == 0:
        layout = (report or {}).get("provenance", {}).get("layout", {})
        tp = layout.get("attn_tp_size", 1)
        return "passed", f"attention TP {tp}" + (" (chosen by kvcache: one rank refused)"
                                                 if layout.get("one_rank_refused_at") else "")
    if rc == 1:
        failed = next((ln for ln in lines if ln.startswith("FAILED")), "")
        detail = failed.removeprefix("FAILED ") or "a check failed (no FAILED line)"
        # the reading sweep's verdict: a model failing only under the assumed device reading says so
        survives = [m.group(1) for n in (report or {}).get("notes", [])
                    for m in [re.match(r"the model depends on the device reading (\w+: it passes under \w+)", n)] if m]
        detail += "".join(f" (device question {v.replace(': it passes under', ': passes under')})" for v in survives)
        where = (report or {}).get("localisation", {}).get("headline")
        return "failed", detail + (f"; localised: {where}" if where else "")
    if rc == 2:
        error = next((ln for ln in lines if ln.startswith("error:")), "")
        return "refused", error.removeprefix("error: ") or "exit 2 (no error line)"
    tail = next((ln for ln in reversed(lines) if ln.strip()), "")
    return "internal", f"exit {rc}: {tail}"


def sweep(root: Path, *, config_dir: Path | None = None, extra: tuple[str, ...] = (), timeout: float = 1800,
          only: list[str] | None = None, say=None) -> list[Row]:
    """Validate every model of ``root`` (or ``only``) in its own process; ``extra``: validate flags for each."""
    say = say or (lambda msg: None)
    specs = _spec_modules(root)
    names = checkout_models(root)
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise InputError(unknown[0], f"is not a model of {root} ({', '.join(names)})", field="--only")
        names = [n for n in names if n in only]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvcache-all-") as tmp:
        for name in names:
            missing = sorted({m.split(".")[1] for m in specs.get(name, []) if m.count(".") >= 2
                              and not (root / "models" / m.split(".")[1]).is_dir()})
            if missing:
                rows.append(Row(name, "absent", f"registered, but models/{missing[0]}/ is not in the checkout", "-"))
                continue
            report = Path(tmp) / f"report-{len(rows)}.json"
            if name not in specs and _standalone(root, name):  # its own runner: validated as the folder runs it
                given = config_dir / f"{name}.json" if config_dir and (config_dir / f"{name}.json").is_file() else None
                source = f"--configs {name}.json" if given else "the folder's config class at its defaults"
                cmd = [sys.executable, "-m", "model_infer_kvcache", "validate", "--runner-root",
                       str(root / "models" / name), "--report", str(report)] + (["--config", str(given)] if given else [])
            else:
                config, source = config_for(root, name, config_dir, Path(tmp))
                if config is None:
                    rows.append(Row(name, "refused", source, "-"))
                    continue
                cmd = [sys.executable, "-m", "model_infer_kvcache", "validate", "--framework-root", str(root),
                       "--model", name, "--config", str(config), "--report", str(report), *extra]
            say(f"{name}: validating ({source})")
            started = time.perf_counter()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                rc, stderr = done.returncode, done.stderr
            except subprocess.TimeoutExpired:
                rc, stderr = 124, f"no answer within {timeout:g} s"
            seconds = time.perf_counter() - started
            data = json.loads(report.read_text(encoding="utf-8")) if report.is_file() else None
            outcome, detail = _outcome(rc, stderr, data)
            rows.append(Row(name, outcome, detail, source, round(seconds, 1), rc))
            say(f"{name}: {outcome} in {seconds:.1f} s")
    return rows


def to_markdown(rows: list[Row], root: Path) -> str:
    counts = ", ".join(f"{sum(r.outcome == o for r in rows)} {o}" for o in OUTCOMES if any(r.outcome == o for r in rows))
    lines = [f"kvcache validate --all: {len(rows)} models of {root} ({counts})", "",
             "| model | outcome | detail | config | seconds |", "|---|---|---|---|---|"]
    for r in rows:
        detail = r.detail.replace("|", "\\|")
        lines.append(f"| {r.model} | {r.outcome} | {detail} | {r.config} | {r.seconds:g} |")
    return "\n".join(lines) + "\n"


def to_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2, ensure_ascii=False) + "\n"
