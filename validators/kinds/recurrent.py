"""Recurrent states of a hybrid's linear layers (gated delta net, KDA, lightning, Mamba-2, Mamba-1): one block per
request."""

from __future__ import annotations

import torch
from model_infer_kvcache.analyzer.linear_config import INNER_IS_INTERMEDIATE, SHARED_BLOCK_HYBRIDS


def expected_constants(manifest) -> dict[str, object]:
    lin = manifest.linear_attention
    if lin is None:
        return {}
    want: dict[str, object] = {"LINEAR_LAYERS": frozenset(lin.layers)}
    dtypes = {s.name: getattr(torch, s.dtype) for s in lin.states}
    if lin.num_v_heads is not None:  # a short conv keeps no recurrent state: none of its constants
        want.update({
            "LINEAR_NUM_K_HEADS_PER_RANK": lin.num_k_heads_per_rank, "LINEAR_NUM_V_HEADS_PER_RANK":
            lin.num_v_heads_per_rank, "LINEAR_HEAD_K_DIM": lin.head_k_dim, "LINEAR_HEAD_V_DIM": lin.head_v_dim})
        want.update(STATE_DTYPE=dtypes.get("recurrent_state"))
    if lin.conv_kernel is not None:  # lightning has no short conv, and so no conv constants
        want.update(CONV_KERNEL=lin.conv_kernel, CONV_CHANNELS_PER_RANK=lin.conv_channels_per_rank,
                    CONV_STATE_DTYPE=dtypes.get("conv_state"))
    return want


def shared_block_prefix(manifest, src: dict, n: int) -> tuple[int, str | None]:
    """The tiny model's layer prefix grown, for a model whose hybrid layers run shared transformer blocks (Zamba2:
    hybrid layer j runs block j % num_mem_blocks, Zamba2Model.get_layers; Zamba: one block), to the first hybrid layer that reuses a
    block: two cache layers of one block's weights, each with its own KV cache, are then both in the run. (n, None)
    for any other model, or when the config has no such layer."""
    if manifest.model.model_type not in SHARED_BLOCK_HYBRIDS:
        return n, None
    # Zamba (v1) has one shared block, every hybrid layer's shared_transf tied to it (ZambaModel._tied_weights_keys)
    blocks = src.get("num_mem_blocks", 1)
    hybrid = [layer.decoder_layer for layer in manifest.layers if layer.sublayer]
    if not isinstance(blocks, int) or len(hybrid) <= blocks or hybrid[blocks] < n:
        return n, None
    shared = f"{blocks} num_mem_blocks" if "num_mem_blocks" in src else "one block tied across every hybrid layer"
    return hybrid[blocks] + 1, (f"the prefix runs to decoder layer {hybrid[blocks]}, hybrid layer {blocks + 1}: the "
                                f"first to reuse a shared block ({shared}), so two cache layers of one "
                                "block's weights are validated")


def states(manifest) -> dict:
    """name -> StateSpec of each state entry a linear layer holds (empty without linear layers)."""
    lin = manifest.linear_attention
    return {s.name: s for s in lin.states} if lin else {}


def state_slots_per_row(manifest) -> int:
    """State slots one runner row holds: 1 + next_n under speculative decoding (one per verify token)."""
    lin = manifest.linear_attention
    return lin.state_blocks_per_request if lin else 1


# The config field a Mamba family sizes its inner width by (expand x hidden_size), when it names no width itself
_EXPAND_FIELDS = ("mamba_expand", "expand")



def tiny_state_fields(d: dict, manifest) -> str | None:
    """The tiny config's Mamba inner width, in place (a note for the tiny model's notes, or None): the rendered code keeps the real heads x head_dim (Mamba-2)
    or inner channels (Mamba-1), so at the tiny hidden size the expand factor grows to give the same width (a
    family naming the width itself, Falcon-H1's ``mamba_d_ssm``, keeps it); a short conv (LFM2) keeps the real
    hidden_size, its conv's channels. Other families: nothing."""
    lin = manifest.linear_attention
    if manifest.model.model_type in SHARED_BLOCK_HYBRIDS:
        # Zamba2Config derives these when absent, and a saved one wins: hybrid_layer_ids (the adapters' index) would
        # name the real model's hybrid layers past the tiny prefix, attention_hidden_size (2 x hidden, the shared
        # block's input) the real width
        d.pop("hybrid_layer_ids", None)
        d.pop("attention_hidden_size", None)
        if d.get("use_shared_attention_adapter"):
            # the LoRA adapters add attention_hidden_size = 2 x hidden columns to the heads x head_dim projections
            # (Zamba2Attention): the tiny hidden size is what makes the two agree
            d["hidden_size"] = manifest.model.num_attention_heads * manifest.model.head_dim // 2
    if lin is not None and lin.family == "rwkv":
        return _tiny_rwkv(d, lin, manifest.parallel.attn_tp_size)
    if lin is not None and lin.family == "mlstm":
        return _tiny_mlstm(d, lin)
    if lin is not None and lin.family == "rg_lru":
        # the render convolves and scans the real lru_width channels: the tiny model keeps them (an absent
        # lru_width would follow the tiny hidden_size, RecurrentGemmaConfig.__post_init__)
        d["lru_width"] = lin.num_v_heads_per_rank * manifest.parallel.attn_tp_size
        return None
    if lin is not None and lin.family == "short_conv":  # the render convolves the real hidden_size channels
        d["hidden_size"] = lin.conv_channels_per_rank * manifest.parallel.attn_tp_size
        return
    if lin is None or lin.family not in ("mamba2", "mamba") or d.get("mamba_d_ssm"):
        return
    inner = lin.num_v_heads * lin.head_v_dim
    field = next((f for f in _EXPAND_FIELDS if f in d), None)
    if field is not None and inner % d["hidden_size"] == 0:
        d[field] = inner // d["hidden_size"]
    if manifest.model.model_type in INNER_IS_INTERMEDIATE:  # the saved width the mixer is built at
        d["intermediate_size"] = inner


# The hidden size an RWKV CPU run keeps (tiny_model.cpu_sized): its render keeps the real widths (below), so RWKV-4's
# class defaults (hidden 4096) ran 4096-wide float64 time-mix matrices, ~100 s a mode
CPU_RWKV_HIDDEN = 128


def cpu_widths(data: dict, manifest, real: dict | None) -> bool:
    """The manifest dump ``data`` at the widths a CPU run affords, in place (RWKV only; False where nothing is cut):
    hidden_size to ``CPU_RWKV_HIDDEN`` and attention_hidden_size by the same factor (their ratio kept), the linear
    section and every layer's states re-derived by the analyzer's own rule (``rules.decide_linear``) from the config
    at those widths, so the constants the implementer renders and the states the checks expect are the analyzer's.
    The layers, the state dtypes, the conv width, the attention TP and the speculative blocks stay. Not cut: no
    config, a width already small, or widths the factor does not divide."""
    lin = manifest.linear_attention
    if real is None or lin is None or lin.family != "rwkv":
        return False
    from model_infer_kvcache.analyzer.config_loader import normalize_config
    from model_infer_kvcache.analyzer.rules import decide_linear

    tp = manifest.parallel.attn_tp_size
    hidden, attn = lin.conv_channels_per_rank // 2, lin.num_v_heads
    factor = hidden // CPU_RWKV_HIDDEN
    if factor < 2 or hidden % factor or attn % (factor * tp):
        return False
    facts = normalize_config({**real, "hidden_size": hidden // factor, "attention_hidden_size": attn // factor})
    conv_dtype = next(s.dtype for s in lin.states if s.name == "conv_state")  # the planned cache dtype
    small = decide_linear(facts, manifest.parallel, conv_dtype, lin.state_blocks_per_request - 1)
    data["linear_attention"] = small.model_dump(mode="json")
    states = data["linear_attention"]["states"]
    for layer in data["layers"]:
        if layer.get("states"):
            layer["states"] = states
    data["model"]["hidden_size"] = hidden // factor
    return True


def cpu_size_changes(manifest, small) -> list[str]:
    """What ``cpu_widths`` changed, for a report note."""
    lin, cut = manifest.linear_attention, small.linear_attention
    if lin is None or lin.conv_channels_per_rank == cut.conv_channels_per_rank:
        return []
    return [f"RWKV hidden_size {lin.conv_channels_per_rank // 2} -> {cut.conv_channels_per_rank // 2} and "
            f"attention_hidden_size {lin.num_v_heads} -> {cut.num_v_heads} (the token shift's "
            f"{lin.conv_channels_per_rank} -> {cut.conv_channels_per_rank} channels, the wkv's {lin.num_v_heads} -> "
            f"{cut.num_v_heads}; layers, dtypes and the recurrence kept)"]


def cpu_widths_reason(manifest, small) -> str | None:
    """Why the CPU run is of narrower states (``cpu_widths`` cut them), for the report's note; None where it did not."""
    if not cpu_size_changes(manifest, small):
        return None
    return f"RWKV's hidden size {manifest.model.hidden_size} makes wide float64 time-mix matrices on CPU"


def _tiny_rwkv(d: dict, lin, tp: int) -> str | None:
    """RWKV: the render keeps the manifest's widths (the token shift's 2 x hidden_size channels, the wkv's
    attention_hidden_size; above ``CPU_RWKV_HIDDEN`` the CPU-sized manifest's, cpu_widths), so the tiny model does
    too. transformers rescales at inference (RwkvModel: block i's
    output and value weights divided by 2 ** (i // rescale_every), the hidden state halved after every
    rescale_every-th block): a tiny prefix shorter than rescale_every would never run it, so every block rescales
    (rescale_every 1) when the real model rescales at all, and the states are validated on rescaled inputs. The weight
    division runs once per model, at its first inference forward (``layers_are_rescaled``): the build's forward
    check sets that flag before the random weights, so the model under test and the reference (a copy, or sharing
    its weights above SHARED_WEIGHTS_ABOVE) carry the same undivided weights and neither divides them."""
    d["hidden_size"] = lin.conv_channels_per_rank // 2
    d["attention_hidden_size"] = lin.num_v_heads_per_rank * tp
    every = d.get("rescale_every", 6)  # RwkvConfig.rescale_every's default
    if isinstance(every, int) and every > 1 and d.get("num_hidden_layers", 0) < every + 1:
        d["rescale_every"] = 1
        return (f"rescale_every {every} -> 1: the {d.get('num_hidden_layers')}-layer prefix halves the hidden state "
                f"after every block (the real model after every {every}th), so the states are validated on rescaled "
                "hidden states; the one-time weight division (RwkvModel._rescale_layers) ran at the build's forward "
                "check, before the random weights were set, so neither model divides them again")
    return None


def _tiny_mlstm(d: dict, lin) -> None:
    """xLSTM: the render keeps the real heads x head dims, so the tiny hidden size projects to them through the dim
    factors (xLSTMLayer: int(hidden_size x qk_dim_factor) / int(hidden_size x v_dim_factor) channels), as Mamba's
    expand grows; embedding_dim and num_blocks follow hidden_size and num_hidden_layers (xLSTMConfig keeps both)."""
    hidden = d["hidden_size"]
    for field, width in (("qk_dim_factor", lin.num_k_heads * lin.head_k_dim),
                         ("v_dim_factor", lin.num_v_heads * lin.head_v_dim)):
        d[field] = width / hidden
        if int(hidden * d[field]) != width:  # a width the tiny hidden size cannot reach by a float factor
            d[field] = (width + 0.5) / hidden
    d["embedding_dim"] = hidden
    d["num_blocks"] = d["num_hidden_layers"]
    return None


def exact_buffers(model, dtype: torch.dtype) -> None:
    """Recompute, in ``dtype``, the buffers a linear module derives at __init__ in float32 (transformers'
    MiniMaxLightningAttention: its slope rate and the block decays from it): cast to float64 they would keep float32's
    rounding (a 1e-8 relative error in every decay the float64 comparison then reads as a difference). The module's
    own methods compute them; the model under test and the reference get the same values."""
    if dtype != torch.float64:
        return
    for module in model.modules():
        if not (hasattr(module, "decay_factors") and hasattr(module, "get_slope_rate")):
            continue
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            rate = module.get_slope_rate(device=module.slope_rate.device).to(dtype)
            query, key, diagonal = module.decay_factors(rate)
        finally:
            torch.set_default_dtype(default)
        module.slope_rate, module.query_decay, module.key_decay, module.diagonal_decay = rate, query, key, diagonal
