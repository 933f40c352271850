"""Find the decoder layers and attention modules of a transformers causal LM by structure.

Layouts differ by family (``model.layers``, ``transformer.h``, ``model.decoder.layers``,
``gpt_neox.layers``, ``language_model.layers``...), so nothing here trusts a name: the decoder
stack is the longest ``nn.ModuleList`` of blocks that hold an attention module, and an
attention module is the outermost submodule of a block that owns query/key/value projections.
Only torch is needed (the analyzer's meta-device check and the validation host both use it).
"""

from __future__ import annotations

from dataclasses import dataclass

from model_infer_kvcache.analyzer.kinds.formats import FORMATS
from model_infer_kvcache.analyzer.linear_config import mixer_facts
from torch import nn

# Projections that make a module an attention module: separate q/k/v, a fused qkv, or the projections an attention
# format names as its own (analyzer/kinds: MLA's compressed KV projection, DeepSeek-V4's shared-KV MQA). Each entry
# is a set of child names that must all be present.
QKV_PROJECTIONS: tuple[frozenset[str], ...] = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"q_proj", "k_proj", "o_proj"}),  # values from the key projection (Gemma-4 attention_k_eq_v)
    frozenset({"q_gate_proj", "k_proj", "v_proj"}),  # query and output gate in one projection (MiniCPM5-MoE)
    frozenset({"query", "key", "value"}),
    frozenset({"query_key_value"}),  # Falcon, GPT-NeoX, Bloom
    frozenset({"qkv_proj"}),  # Phi-3
    frozenset({"c_attn"}),  # GPT-2 family
    frozenset({"W_pack"}),  # Baichuan (remote code)
    frozenset({"Wqkv"}),  # MPT
    frozenset({"Wq", "Wk", "Wv"}),  # CTRL
    frozenset({"q_lin", "k_lin", "v_lin"}),  # XLM's MultiHeadAttention
    # JetMoE's mixture of attention: per-token query / output experts (JetMoeMoA map / reduce) over one shared kv_proj
    frozenset({"experts", "kv_proj"}),
    *(projections for fmt in FORMATS for projections in fmt.hf_projections),
)


class LayoutError(LookupError):
    """The model's module tree has no recognisable decoder stack / attention module."""


@dataclass(frozen=True)
class DecoderStack:
    path: str  # dotted path of the ModuleList inside the model
    layers: nn.ModuleList


def is_attention(module: nn.Module) -> bool:
    names = {name for name, _ in module.named_children()}
    # a KV-shared attention (Gemma-3n / Gemma-4 is_kv_shared_layer): queries and output only, its K/V another
    # layer's (transformers builds no k_proj / v_proj there)
    shared = getattr(module, "is_kv_shared_layer", False) is True and {"q_proj", "o_proj"} <= names
    return shared or any(need <= names for need in QKV_PROJECTIONS)


def find_attentions(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """(relative path, module) of each outermost attention module inside one decoder block, in
    order (LongCat-Flash blocks hold two). A block that is itself the attention module gives ("", block): XLM keeps
    its layers as parallel lists (``attentions``, ``ffns``, ``layer_norm1`` / ``2``), no block class around them."""
    if is_attention(block):
        return [("", block)]
    found: list[tuple[str, nn.Module]] = []
    for name, module in block.named_modules():
        if name and is_attention(module) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


def find_decoder_stack(model: nn.Module, stacks: tuple[str, ...] | None = None) -> DecoderStack:
    """The decoder stack; ``stacks`` given (HRM's ``L_module.layers``, ``H_module.layers``: analyzer/kinds/loops), the
    concatenation of the ModuleLists at those paths (under the model's wrapper), in that order, as one stack.

    Else the longest ModuleList of blocks holding attention modules (hybrids: some blocks, and their blocks may be of
    several classes: Jamba / Bamba build a Mamba layer class beside an attention layer class).

    Ties go to the shallowest path (a text decoder over a nested stack of the same length). A stack whose every
    attention module says it is not causal (``is_causal`` False: GIT's vision encoder, 12 blocks beside its 6-block
    text decoder) is a tower the decoder reads from, not the decoder: it is chosen only when no other stack is
    there (a BERT-era encoder built with is_decoder false, which the cross-check then refuses as bidirectional).
    """
    if stacks:
        return _joined_stacks(model, stacks)
    best: tuple[int, int, int, int, str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        attentions = [m for b in module for _, m in find_attentions(b)]
        if not attentions:
            continue
        # a list of bare attention modules (XLM's ``attentions``) is a stack only where no list of blocks is: a
        # block's own list of attentions (LongCat-Flash's two per layer) must not outrank a short decoder stack
        blocks = int(not all(is_attention(b) for b in module))
        key = (int(not noncausal_tower(attentions)), blocks, len(module), -path.count("."))
        if best is None or key > best[:4]:
            best = (*key, path, module)
    if best is None:
        # a stack of Mamba blocks only (Granite-4.0-H / Bamba at their class defaults, Mamba2): blocks holding a mixer
        for path, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) and all(_holds_mixer(b) for b in module):
                key = (1, 1, len(module), -path.count("."))
                if best is None or key > best[:4]:
                    best = (*key, path, module)
    if best is None:
        raise LayoutError(f"{type(model).__name__}: no nn.ModuleList of decoder blocks holding an attention module "
                          f"(a child with one of {', '.join('+'.join(sorted(p)) for p in QKV_PROJECTIONS)})")
    return DecoderStack(best[4], best[5])


def _joined_stacks(model: nn.Module, stacks: tuple[str, ...]) -> DecoderStack:
    """The ModuleLists at the paths ``stacks`` (each the shallowest match of its path's end) joined into one stack,
    path ``a+b``: a decoder whose layers sit in several stacks called in turn."""
    found = []
    for tail in stacks:
        hits = [(path, m) for path, m in model.named_modules()
                if isinstance(m, nn.ModuleList) and (path == tail or path.endswith(f".{tail}"))]
        if not hits:
            raise LayoutError(f"{type(model).__name__}: no nn.ModuleList at *.{tail}")
        found.append(min(hits, key=lambda hit: hit[0].count(".")))
    return DecoderStack("+".join(path for path, _ in found), nn.ModuleList([b for _, m in found for b in m]))


def noncausal_tower(attentions: list[nn.Module]) -> bool:
    """Every attention module of a stack says it is not causal (``is_causal`` False, GitVisionAttention): an encoder
    tower beside the decoder. A module that sets no ``is_causal`` says nothing."""
    return all(getattr(m, "is_causal", None) is False for m in attentions)


def _holds_mixer(block: nn.Module) -> bool:
    """A decoder block holding a Mamba mixer (analyzer/linear_config.mixer_facts reads its sizes)."""
    return any(mixer_facts(m) for m in block.modules())


def attention_modules(model: nn.Module, stack: DecoderStack | None = None) -> list[tuple[str, nn.Module | None]]:
    """Every attention module in decoder order as (dotted path, module); a block without one
    (linear-attention / recurrent layer of a hybrid stack) gives (path of the block, None). ``stack``: the model's
    decoder stack when the caller has found it already."""
    stack = stack or find_decoder_stack(model)
    out: list[tuple[str, nn.Module | None]] = []
    for i, block in enumerate(stack.layers):
        where = f"{stack.path}.{i}"
        hits = find_attentions(block)
        out += [(f"{where}.{name}" if name else where, module) for name, module in hits] if hits else [(where, None)]
    return out
