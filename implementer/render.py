"""Render a manifest into files: deterministic, validated, all-or-nothing."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import jinja2
from model_infer_kvcache.analyzer.decisions_table import decision_rows
from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.files import atomic_write_bytes, atomic_write_text, signals_held
from model_infer_kvcache.analyzer.manifest import SelectionManifest
from model_infer_kvcache.implementer.kinds import attention_kind, renders_layer_shapes
from model_infer_kvcache.implementer.kinds import byte_patches as byte_patches_kind
from model_infer_kvcache.implementer.kinds import drafter as drafter_kind
from model_infer_kvcache.implementer.template_context import Names, RenderContext, build_context, one_line

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"
ATTENTION_FILE = "kvcache_attention.py"
RUNNER_FILE = "kvcache_runner.py"
INTEGRATION_FILE = "INTEGRATION.md"


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def plan_files(c: RenderContext) -> dict[str, str]:
    """Output file name -> template, by deployment and KV mode."""
    attention = "legacy_attention.py.j2" if c.kv_mode == "legacy" else "paged_attention.py.j2"
    files = {ATTENTION_FILE: attention}
    if c.deploy_mode == "standalone":
        files[RUNNER_FILE] = "standalone_legacy_runner.py.j2" if c.kv_mode == "legacy" else "standalone_runner.py.j2"
    return files


@dataclass(frozen=True)
class Rendered:
    files: dict[str, str]  # relative path -> text
    context: RenderContext | None  # None: a drafter's or BLT's render (implementer/kinds/drafter.py, byte_patches.py)


def check_renderable(manifest: SelectionManifest, flag: str = "--manifest") -> None:
    """Refuse a manifest whose cache kinds no template renders (exit 2 "not supported by kvcache yet")."""
    if manifest.byte_patches is not None:  # BLT's render gives each stack its own shape (implementer/kinds/byte_patches)
        return
    shared = [layer for layer in manifest.layers if layer.kv_source_layer is not None]
    if shared and manifest.kv_mode.value != "paged":
        raise InputError(flag, f"not supported by kvcache yet: KV-shared layers ({len(shared)}, first layer "
                         f"{shared[0].index} reading layer {shared[0].kv_source_layer}'s cache) on a "
                         f"{manifest.kv_mode.value} cache: only the paged templates read a source layer's cache",
                         field=f"layers[{shared[0].index}].kv_source_layer")
    shaped = [layer for layer in manifest.layers if layer.head_dim is not None or layer.num_kv_heads_per_rank is not None]
    if shaped and not renders_layer_shapes(manifest):
        # The paged GQA templates give each layer its own K/V shape (LAYER_SHAPES); the Legacy and the other kinds'
        # templates take one HEAD_DIM and one KV head count, which would size the differing layers' caches wrongly.
        first = shaped[0]
        what = f"a {manifest.kv_mode.value} cache" if manifest.kv_mode.value != "paged" else \
            f"{attention_kind(manifest).NAME} layers"
        raise InputError(flag, f"not supported by kvcache yet: per-layer attention shapes ({len(shaped)} layer(s), "
                         f"first layer {first.index}: head_dim {first.head_dim or manifest.model.head_dim}, "
                         f"{first.num_kv_heads_per_rank or manifest.parallel.num_kv_heads_per_rank} KV heads per rank) "
                         f"on {what}: only the paged GQA/MHA templates render a shape per layer",
                         field=f"layers[{first.index}].head_dim")


def render_manifest(
    manifest: SelectionManifest,
    names: Names | None = None,
    framework_api: str | None = None,
    allow_blocked: bool = False,
    source: str = "--manifest",
) -> Rendered:
    """The rendered files of ``manifest``; bad input raises InputError naming ``source``: the manifest flag,
    or what the user gave where the manifest is an inner stage's (``kvcache run``: the config)."""
    try:
        return _render(manifest, names or Names(), framework_api, allow_blocked)
    except InputError as exc:
        if exc.where != "--manifest" or source == "--manifest":
            raise
        field = exc.field if exc.field in (None, "blockers") else f"its manifest's {exc.field}"
        raise InputError(source, exc.message, field=field) from None


def decision_cells(manifest: SelectionManifest) -> list[tuple[str, ...]]:
    """The manifest's decision rows as INTEGRATION.md's table cells: one line each, pipes escaped."""
    return [tuple(one_line(str(cell)).replace("|", "\\|") for cell in row) for row in decision_rows(manifest)]


def _render(manifest: SelectionManifest, names: Names, framework_api: str | None, allow_blocked: bool) -> Rendered:
    if manifest.byte_patches is not None:  # BLT's stacks: their own attention file, no runner, no context
        return Rendered(byte_patches_kind.render_manifest(manifest, _environment(), ATTENTION_FILE, INTEGRATION_FILE,
                                                          decision_cells(manifest)), None)
    if manifest.blockers and not allow_blocked:
        blocked = "; ".join(b.message for b in manifest.blockers)
        try:  # the hint must lead somewhere: --allow-blocked helps only where a template renders the model
            check_renderable(manifest)
            build_context(manifest, names, framework_api)
        except InputError as exc:
            raise NotSupportedByKvcache("--manifest", f"this model has blockers ({blocked}) and no template renders "
                                        f"its Legacy path either ({exc.field}: {exc.message})",
                                        field="blockers") from None
        raise InputError("--manifest", f"manifest has blockers ({blocked}): pass --allow-blocked to render the "
                                       "Legacy path anyway", field="blockers")
    if manifest.drafter is not None:  # a drafter over its target's cache: its own file, no runner, no context
        return Rendered(drafter_kind.render(manifest, _environment(), ATTENTION_FILE, INTEGRATION_FILE,
                                            decision_cells(manifest)), None)
    check_renderable(manifest)
    c = build_context(manifest, names, framework_api)
    env = _environment()
    out = {name: env.get_template(t).render(c=c) for name, t in plan_files(c).items()}
    out[INTEGRATION_FILE] = env.get_template("integration.md.j2").render(
        c=c, files=sorted(out), decisions=decision_cells(manifest), out_hint="<render dir>"
    )
    return Rendered(out, c)


def _check_targets(rendered: Rendered, root: Path, force: bool) -> list[tuple[str, Path]]:
    """Every target resolved and checked before anything is written."""
    if root.exists() and not root.is_dir():
        raise InputError(str(root), "exists and is not a directory", field="--out")
    base = root.resolve()
    targets = []
    for rel in sorted(rendered.files):
        target = (root / rel).resolve()  # symlinks resolved: a link pointing outside escapes too
        if base not in target.parents:
            raise InputError(str(root / rel), "output path escapes --out", field="--out")
        if target.is_dir():
            raise InputError(str(target), "is a directory", field="--out")
        if target.exists() and not force:
            raise InputError(str(target), "exists: pass --force to overwrite", field="--force")
        targets.append((rel, target))
    return targets


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its missing ancestors, outermost first (what mkdir(parents=True) would create)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    return missing[::-1]


def write_rendered(rendered: Rendered, out_dir: str | Path, force: bool = False) -> list[Path]:
    """Write every file or none.

    All targets are checked first; then each file is written atomically. If a later write
    fails, the files this call replaced get their old bytes back, the files it created are
    removed, and so are the directories it created.
    """
    root = Path(out_dir)
    targets = _check_targets(rendered, root, force)
    created_dirs: list[Path] = []
    previous: list[tuple[Path, bytes | None]] = []
    try:
        for rel, target in targets:
            for folder in _missing_dirs(target.parent):
                with signals_held():  # made and listed in one step: a signal in between would leave it behind
                    folder.mkdir()
                    created_dirs.append(folder)
            previous.append((target, target.read_bytes() if target.exists() else None))
            atomic_write_text(target, rendered.files[rel])
    except BaseException:
        for target, old in reversed(previous):
            if old is None:
                target.unlink(missing_ok=True)
            else:
                atomic_write_bytes(target, old)
        for folder in reversed(created_dirs):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return [target for _, target in targets]
