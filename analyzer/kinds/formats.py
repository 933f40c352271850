"""Which attention format a model's config facts hold: the one place the analyzer asks it.

The decision rules and the plan builder ask the returned format (``analyzer/kinds/gqa.py`` and its refinements)
instead of branching on the config's MLA / DSA / compressed facts; a new format is a module here and one line below.
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.kinds import (
    DIFF,
    DSA,
    MLA,
    QSA,
    attention_format,
    compressed,
    diff,
    dsa,
    gqa,
    mla,
    qsa,
)
from model_infer_kvcache.analyzer.kinds.gqa import Facts, GqaFormat
from model_infer_kvcache.analyzer.linear_config import mixer_facts

FORMATS: tuple[GqaFormat, ...] = (gqa.FORMAT, mla.FORMAT, dsa.FORMAT, compressed.FORMAT, qsa.FORMAT, diff.FORMAT)


def hf_module_facts(module) -> tuple[tuple[str, int | None], ...]:
    """What every format reads off a transformers attention module (analyzer/arch_check.py's cross-check), as
    sorted pairs: a model's module may hold parts of a format its plan lacks, which the plan's format then names."""
    found: dict[str, int | None] = {}
    for fmt in FORMATS:
        found.update(fmt.hf_facts(module))
    found.update(mixer_facts(module))  # a Mamba mixer's sizes (the recurrent state's, analyzer/linear_config)
    return tuple(sorted(found.items()))


def format_of(facts: Facts) -> GqaFormat:
    """The most specific format the facts name: compressed (DeepSeek-V4), QSA (Qwen4-Exp), differential (DiffLlama),
    DSA (MLA + indexer), MLA, else GQA."""
    if facts.compressed.value is not None:
        return compressed.FORMAT
    if facts.qsa.value is not None:
        return qsa.FORMAT
    if facts.diff.value is not None:
        return diff.FORMAT
    if facts.dsa.value is not None:
        return dsa.FORMAT
    if facts.mla.value is not None:
        return mla.FORMAT
    return gqa.FORMAT


def format_of_manifest(m) -> GqaFormat:
    """The format a manifest plans, read from its sections the way ``format_of`` reads the facts."""
    if m.compressed is not None:
        return compressed.FORMAT
    return {DSA: dsa.FORMAT, MLA: mla.FORMAT, QSA: qsa.FORMAT, DIFF: diff.FORMAT}.get(attention_format(m), gqa.FORMAT)
