"""BLT's stacks (analyzer/kinds/byte_patches.py), render side: the manifest's ``byte_patches`` section as one
attention file, each stack's FA call with its own heads, scale and band (the gqa partial reads one model-level
NUM_HEADS_PER_RANK / SOFTMAX_SCALE, which BLT's stacks do not share) and the patch-boundary rule, plus INTEGRATION.md.
No runner: the validators' byte-stepping host (validators/pipeline/byte_patch_run.py) drives it in both modes.

The deploy mode changes where a call's rows come from: in framework mode the engine hands ``block_table`` and
``slot_mapping`` per manager (one per stack) and per byte position, so the global stack's slots (a row per completed
patch) are computed by the rendered code from its own block table and each row's patch index; in standalone mode the
runner hands each stack's own.
"""

from __future__ import annotations

import hashlib

import jinja2
from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache
from model_infer_kvcache.analyzer.framework_checkout import DEFAULT_RENDER_CONTRACT, render_api
from model_infer_kvcache.analyzer.kinds import byte_patch_section
from model_infer_kvcache.analyzer.manifest import BytePatchesDecision, SelectionManifest
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS
from model_infer_kvcache.analyzer.version import __version__
from model_infer_kvcache.implementer.header import GENERATED_MARK, design_line, generated_line
from model_infer_kvcache.implementer.kinds.common import bad

TEMPLATE = "kinds/byte_patches_attention.py.j2"
# the rendered file's module-level constants (the section's numbers); the rest is code. The validators run a given
# render's code with the constants of a CPU-sized section put in their place (its own checked against the manifest).
CONSTANTS = ("DEPLOY_MODE", "ENTROPY_PATCHING", "PATCHING_THRESHOLD", "MAX_PATCH_LENGTH", "OPEN_PATCH_ROWS",
             "CROSS_ATTN_K", "STACKS", "CROSS", "DECODER_CROSS_LAYERS")
INTEGRATION_TEMPLATE = "kinds/byte_patches_integration.md.j2"


def section_hash(section: BytePatchesDecision) -> str:
    """The section's content hash, for a render of a section alone (the validators' CPU-sized one)."""
    return hashlib.sha256(section.model_dump_json().encode()).hexdigest()[:16]


def check(section: BytePatchesDecision) -> None:
    """A section the render serves: its invariants hold (a hand edit that breaks one is refused by field)."""
    found = byte_patch_section.problems(section)
    if found:
        raise bad(*found[0])


def render(section: BytePatchesDecision, env: jinja2.Environment, attention_file: str, model_type: str = "blt",
           fa_version: str = "v1", deploy_mode: str = "standalone", lines: tuple[str, str] | None = None
           ) -> dict[str, str]:
    """The attention file of ``section``; ``lines``: its generated and design lines (a manifest's), else the
    section's own hash names it."""
    check(section)
    generated, design = lines or (
        f"{GENERATED_MARK} {__version__} from a byte_patches section {section_hash(section)} (no manifest).",
        design_line(model_type, deploy_mode, None, "paged", fa_version, "TND"))
    c = dict(generated_line=generated, design_line=design, model_type=model_type, deploy_mode=deploy_mode,
             section=section, fa=FA_KEYWORDS[fa_version], threshold=repr(section.patching_threshold),
             scales={s.section: repr(float(s.softmax_scale)) for s in section.stacks})
    return {attention_file: env.get_template(TEMPLATE).render(c=c)}


def render_manifest(m: SelectionManifest, env: jinja2.Environment, attention_file: str, integration_file: str,
                    decisions: list[tuple[str, ...]]) -> dict[str, str]:
    """A BLT manifest's files: the attention file (its header naming the manifest's hash) and INTEGRATION.md."""
    if m.blockers:  # no Legacy path to fall back on: every stack's attention is a paged FA call
        raise NotSupportedByKvcache("--manifest", "manifest has blockers (" + "; ".join(b.message for b in m.blockers)
                                    + "): BLT renders no Legacy path", field="blockers")
    if m.kv_mode.value != "paged" or m.fa.input_layout != "TND":
        raise bad("kv_mode", f"{m.kv_mode.value} / {m.fa.input_layout}: BLT's stacks render paged TND FA calls only")
    if m.exe_mode is not None and m.exe_mode.value != "eager":
        raise bad("exe_mode", f"not supported by kvcache yet: a {m.exe_mode.value} BLT step ({m.exe_mode.source}): the "
                              "patch boundary branches per request on the patcher's entropy; rendered and validated "
                              "eager only")
    lines = (generated_line(__version__, m.content_hash()),
             design_line(m.model.model_type, m.deploy_mode.value, render_api(m.framework_api or DEFAULT_RENDER_CONTRACT),
                         m.kv_mode.value, m.fa.version, m.fa.input_layout))
    files = render(m.byte_patches, env, attention_file, m.model.model_type, m.fa.version, m.deploy_mode.value, lines)
    files[integration_file] = env.get_template(INTEGRATION_TEMPLATE).render(
        c=dict(generated_line=lines[0], model_type=m.model.model_type, deploy_mode=m.deploy_mode.value,
               section=m.byte_patches), files=sorted(files), decisions=decisions)
    return files
