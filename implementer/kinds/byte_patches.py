"""BLT's stacks (analyzer/kinds/byte_patches.py), render side: the manifest's ``byte_patches`` section as one
attention file, each stack's FA call with its own heads, scale and band (the gqa partial reads one model-level
NUM_HEADS_PER_RANK / SOFTMAX_SCALE, which BLT's stacks do not share) and the patch-boundary rule.

The rendered ``KVCacheBytePatchAttention.kv_cache_attention`` has the gqa partial's shape, so the validators' host
(validators/pipeline/byte_patch_run.py) runs it in place of its own; ``ends_patch`` is the boundary the host steps
the global stack at.
"""

from __future__ import annotations

import hashlib

import jinja2
from model_infer_kvcache.analyzer.kinds import byte_patch_section
from model_infer_kvcache.analyzer.manifest import BytePatchesDecision
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS
from model_infer_kvcache.analyzer.version import __version__
from model_infer_kvcache.implementer.header import GENERATED_MARK
from model_infer_kvcache.implementer.kinds.common import bad

TEMPLATE = "kinds/byte_patches_attention.py.j2"


def section_hash(section: BytePatchesDecision) -> str:
    """The section's content hash for the generated line."""
    return hashlib.sha256(section.model_dump_json().encode()).hexdigest()[:16]


def check(section: BytePatchesDecision) -> None:
    """A section the render serves: its invariants hold (a hand edit that breaks one is refused by field)."""
    found = byte_patch_section.problems(section)
    if found:
        raise bad(*found[0])


def render(section: BytePatchesDecision, env: jinja2.Environment, attention_file: str, model_type: str = "blt",
           fa_version: str = "v1") -> dict[str, str]:
    check(section)
    # no manifest carries the section yet: the line names the section's own hash, not a manifest's
    line = f"{GENERATED_MARK} {__version__} from a byte_patches section {section_hash(section)} (no manifest yet)."
    c = dict(generated_line=line, model_type=model_type,
             section=section, fa=FA_KEYWORDS[fa_version], threshold=repr(section.patching_threshold),
             scales={s.section: repr(float(s.softmax_scale)) for s in section.stacks})
    return {attention_file: env.get_template(TEMPLATE).render(c=c)}
