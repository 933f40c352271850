"""What kvcache cannot validate yet, said as such: "not supported by kvcache: <what>" (exit 2), never a model failure.

Two moments. Once the model class is known, ``preflight(config_path, manifest)`` refuses a format the run cannot
drive (the format's ``checkout_refusal``: DeepSeek-V4's compressed attention, its operators not emulated, its branch
not compared yet) and linear-attention layers the
manifest names no validation reference for (``linear_attention.reference`` null). Every family the analyzer plans
has one today (transformers' gated delta net and KDA classes; for Ling-2.5's lightning attention, which transformers
lacks, kvcache's own reference: ``validators/pipeline/ling_lightning.py``), so only a manifest written by an older
kvcache (which left Ling-2.5's null) meets it: re-analyze.
During the run, ``unsupported_operator(exc, model_frame)`` turns an operator the emulation lacks into the same one
line when the operator is real (a torch-npu release of ``analyzer/operators/op_names.json`` defines it) or a feature
of an emulated operator that is not emulated; an operator no release defines stays the model's own error (exit 1,
at its file:line). ``missing_package(exc, root, model_file)`` does the same for a package the model imports that is
not installed here and has no stand-in (a vendor operator package): exit 2 naming it, where the checkout imports it,
and what the model files use of it, found statically; a model that cannot import on CPU has not failed.
``missing_config_field(exc, config_path, frame)``: a config attribute the model reads that neither the config nor
the folder's config class supplies is bad input (exit 2) naming the field and the line that reads it.
"""

from __future__ import annotations

import ast
import re
import sys
import traceback
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.kinds.formats import format_of_manifest


def preflight(config_path: str, manifest) -> None:
    """Raise ``NotSupportedByKvcache`` naming the config's linear-attention family when the manifest names no
    reference for it (``manifest.linear_attention.reference`` is None: a manifest of an older kvcache)."""
    refused = format_of_manifest(manifest).checkout_refusal(manifest)
    if refused:  # a format the run cannot drive yet (its operators not emulated): the format says what and why
        field, why = refused
        raise NotSupportedByKvcache(config_path, why, field=field)
    lin = manifest.linear_attention
    if lin is not None and lin.reference is None:
        raise NotSupportedByKvcache(config_path, f"linear-attention layers of family {lin.family} ({lin.source}): "
                                                 "the manifest names no reference to compare the logits with "
                                                 "(linear_attention.reference is null; re-run kvcache analyze)",
                                    field="model_type")


def unsupported_operator(exc: BaseException, where: str, root=None) -> NotSupportedByKvcache | None:
    """The one line for an operator (or an operator's feature) the emulation lacks, or None when ``exc`` is
    not that (a model error, an operator's refusal, an operator neither a torch-npu release nor the checkout
    ``root`` (its ``ops/ascendc/docs/custom-<op>.md``) defines)."""
    from model_infer_kvcache.analyzer.operators.schemas import PINNED_RELEASE, releases_defining
    from model_infer_kvcache.validators.npu_ops.errors import UnemulatedFeatureError, UnemulatedOperatorError

    if isinstance(exc, UnemulatedFeatureError):
        return NotSupportedByKvcache(where, f"{exc} (an emulated operator's feature)", field=f"{exc.op}")
    if isinstance(exc, UnemulatedOperatorError) and exc.op.startswith(("custom_ops.", "torch.ops.custom.")):
        name = exc.op.rsplit(".", 1)[-1]
        return NotSupportedByKvcache(where, f"operator {exc.op} (the checkout's own AscendC operator, "
                                            f"ops/ascendc/docs/custom-{name}.md) is not emulated on CPU", field=exc.op)
    if isinstance(exc, UnemulatedOperatorError):
        name = exc.op.rsplit(".", 1)[-1]
        releases = releases_defining(name)
        doc = f"ops/ascendc/docs/custom-{name}.md"
        if not releases and root is not None and (root / doc).is_file():
            # the checkout's own operator reached through torch_npu (DeepSeek-V3.2's KV offload path)
            return NotSupportedByKvcache(where, f"operator {exc.op} (the checkout's own AscendC operator, {doc}) is "
                                                "not emulated on CPU", field=exc.op)
        if not releases:
            return None
        doc = "the pinned release" if PINNED_RELEASE in releases else f"torch-npu {', '.join(releases)}"
        return NotSupportedByKvcache(where, f"operator {exc.op} (defined by {doc}) is not emulated on CPU "
                                            "(references/emulated_ops.md)", field=exc.op)
    return None


def missing_package(exc: BaseException, root: Path, model_file: str | None = None) -> NotSupportedByKvcache | None:
    """The one line for an import of a package that is not installed here and that kvcache stands in for nowhere,
    made by a file of the checkout or by ``model_file`` (the user's edited copy); None otherwise (a module the
    checkout itself lacks is its own error). Names the package, the importing file:line and what the model folder's
    Python files (and ``model_file``) use of it."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    if top in sys.modules or (root / top).exists() or (root / f"{top}.py").exists():
        return None  # a stand-in's submodule, or a module of the checkout's own tree: not a missing package
    checkout = root.resolve()
    own = Path(model_file).resolve() if model_file else None

    def ours(filename: str) -> bool:
        path = Path(filename).resolve()
        return path == own or checkout in path.parents

    at = next((f for f in reversed(traceback.extract_tb(exc.__traceback__)) if ours(f.filename)), None)
    if at is None:
        return None
    importer = Path(at.filename).resolve()
    rel = importer.relative_to(checkout) if checkout in importer.parents else None
    where = f"{rel or importer.name}:{at.lineno}"
    folders = [checkout / "models" / rel.parts[1]] if rel is not None and rel.parts[0] == "models" else [importer]
    used = sorted(package_uses(top, folders + ([own] if own else [])))
    shown = ", ".join(used[:12]) + (f" (+{len(used) - 12} more)" if len(used) > 12 else "") if used else "none found"
    return NotSupportedByKvcache(where, f"package {top} (imported at {where}: an operator or vendor package this "
                                        f"machine lacks and kvcache has no stand-in for); what the model files use of "
                                        f"it: {shown}", field=f"import {exc.name}")


def package_uses(package: str, folders: list[Path]) -> set[str]:
    """``package.name`` for every name the Python files under ``folders`` import from ``package`` or reach as an
    attribute of it (``import package as p`` ... ``p.op(...)``; ``torch.ops.package.op``), read without running."""
    out: set[str] = set()
    files = sorted({f for folder in folders for f in ([folder] if folder.is_file() else folder.rglob("*.py"))})
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == package}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
                out |= {f"{node.module}.{a.name}" for a in node.names if a.name != "*"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                dotted = _dotted(node.value)
                if dotted in aliases or dotted == f"torch.ops.{package}":
                    out.add(f"{dotted}.{node.attr}")
    return out


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def missing_config_field(exc: BaseException, config_path: str, frame: str) -> InputError | None:
    """The one line for a config attribute the model reads that neither the config.json nor the folder's own config
    class supplies (``AttributeError`` on a ``PretrainedConfig``): bad input naming the field and the file:line
    that reads it, exit 2; never the model's runtime failure. None for any other error."""
    obj = getattr(exc, "obj", None)
    name = getattr(exc, "name", None)
    if not isinstance(exc, AttributeError) or not name or not _is_config(obj):
        return None
    return InputError(config_path, f"missing: {frame} reads config.{name}, and neither this config nor "
                                   f"{type(obj).__name__} (the config class the checkout registers for the model, "
                                   "which the run builds the config through) supplies it: add the field to the config",
                      field=name)


_CONFIG_READ = re.compile(r"\bconfig\.(\w+)")


def none_config_field(exc: BaseException, config_path: str) -> InputError | None:
    """The one line for a config field the model uses as a value (``config.rope_scaling["factor"]``, ``key in
    config.rope_scaling``) that is None in the config the run was given (unset, the class default): exit 2 naming
    the field and the file:line that reads it. Only where the failing line reads that field and the config the
    frame holds has it None; None for any other error."""
    if not isinstance(exc, TypeError) or "NoneType" not in str(exc) or exc.__traceback__ is None:
        return None
    import linecache

    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame, lineno = tb.tb_frame, tb.tb_lineno
    line = linecache.getline(frame.f_code.co_filename, lineno)
    holders = [frame.f_locals.get("config"), getattr(frame.f_locals.get("self"), "config", None)]
    configs = [c for c in holders if _is_config(c)]
    from model_infer_kvcache.validators.checkout_run.compat import legacy_rope_value

    def none(config, name: str) -> bool:
        # the run read rope_scaling the 4.x way (compat.legacy_rope_scaling, undone by now): None when unscaled
        value = getattr(config, name, 0)
        return (legacy_rope_value(value) if name == "rope_scaling" else value) is None

    for name in _CONFIG_READ.findall(line):
        if any(none(c, name) for c in configs):
            where = f"{Path(frame.f_code.co_filename).name}:{lineno}"
            return InputError(config_path, f"{where} uses config.{name} as a value, and it is None in this config "
                                           "(unset, or its class's default): give a config that sets it, as the "
                                           "model's published config.json does", field=name)
    return None


def _is_config(obj) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return False
    return isinstance(obj, PretrainedConfig)
