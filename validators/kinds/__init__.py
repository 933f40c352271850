"""The validators' side of each cache kind: what is checked about it.

One module per kind, as ``implementer/kinds/`` on the render side: ``gqa`` (K/V caches, FA calls), ``mla`` (the
latent cache, FA calls with one KV head), ``dsa`` (MLA plus the indexer: its calls are the indexer's and the sparse
FA's, no FA call), ``compressed`` (DeepSeek-V4: one shared-KV attention call over the window and CSA / HCA branches, no FA
call), ``qsa`` (Qwen4-Exp: GQA plus the indexer's block keys; its calls the indexer's and the sparse FA's, V235),
``diff`` (DiffLlama: GQA's checks over four FA calls of half the heads), ``recurrent`` (the linear layers' states). Each states, independently of the implementer (a
check must not take its expectation from the code it checks), the module constants a render must define
(``expected_constants``); the attention kinds also what their calls must pass. ``kind_of`` / ``kinds_of`` map a
manifest to them through ``analyzer.kinds.attention_format``, the one place that reads which kinds a manifest holds.
"""

from __future__ import annotations

from types import ModuleType

from model_infer_kvcache.analyzer.kinds import (
    COMPRESSED,
    DIFF,
    DSA,
    GQA,
    MLA,
    QSA,
    attention_format,
    holds_states,
)
from model_infer_kvcache.validators.kinds import compressed, diff, dsa, gqa, mla, qsa, recurrent

_BY_FORMAT = {COMPRESSED: compressed, DSA: dsa, MLA: mla, GQA: gqa, QSA: qsa, DIFF: diff}


def kind_of(manifest) -> ModuleType:
    """The attention kind every attention layer of the manifest shares."""
    return _BY_FORMAT[attention_format(manifest)]


def kinds_of(manifest) -> tuple[ModuleType, ...]:
    """The attention kind, then the recurrent state of a hybrid's linear layers."""
    return (kind_of(manifest), *((recurrent,) if holds_states(manifest) else ()))


def check_attention_calls(report, manifest, host, *, before_failure: bool = False) -> None:
    """A rendered run's attention calls, judged by the manifest's attention kind (``before_failure``: an operator
    error or the watchdog stopped the run; the calls made up to it are judged, checks without evidence left out)."""
    if not manifest.attention_layers:  # a pure state stack makes no attention call (numeric.check_runtime's note)
        return
    kind_of(manifest).check_attention_calls(report, manifest, host, before_failure=before_failure)


__all__ = ["check_attention_calls", "kind_of", "kinds_of"]
