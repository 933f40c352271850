"""Drive BLT (transformers ``BltForCausalLM``) byte by byte on the paged caches analyzer/kinds/byte_patches.py plans,
and judge it by transformers' full forward (no cache: the recompute oracle; transformers' own cached path reruns the
patcher, the global transformer and the cross-attentions over each step's byte alone, so it is no reference).

Every stack's self-attention runs as a port would: the host runs the transformers module's q/k/v projections, RoPE
and o_proj around ``PagedAttention.kv_cache_attention`` (the port's part, shaped like the gqa partial's: the step's
K/V written into the stack's paged pool with ``npu_scatter_nd_update_`` at ``slot_mapping``, then one packed (TND)
``npu_fused_infer_attention_score`` call over the pool through ``block_table``), the band from the analyzer's rules
for the stack's attn_type (``band``: a windowed stack sparse_mode 4 with pre_tokens from its window, the global stack
causal mode 3). The requests step together, admitted late and finishing early, each feeding one byte per step (its
prompt, then its greedy bytes). Per request the host keeps what transformers recomputes: the open patch's encoder
rows (they pool into the patch at its end) and, per decoder cross-attention layer, the K/V of the latest completed
patch in a slot of its own (``cross_attn_k`` rows, rewritten with ``npu_scatter_nd_update_`` at each patch end, read
by FA through a one-block table with sparse_mode 0). At a byte that ends a patch (``byte_patches.ends_patch`` on the
patcher's entropy at that byte) the global stack steps for the requests that ended one: one row per completed patch.

Checks (IDs in check_ids): V117 the pools as planned, V234 every FA call reads its stack's own cache at the kv_len
the request's bytes (or completed patches, at exactly the bytes transformers' own patcher ends them) give, V309 /
V310 logits and greedy bytes against the full forward, V408 every block, cross slot and per-request state released
(released blocks and slots are NaN: a later read of one shows in V309). A boundary that differs from transformers'
only where its entropy lies within rounding of the threshold (bfloat16: the stepped and whole-sequence patchers
round differently) is judged with the run's own, transformers' forward given the run's entropies; a greedy byte
that differs on a near-tie (margin within 2 x the logits' difference) is accepted as V302 accepts one. Knobs for
the negative controls: ``boundary_shift`` (the boundary read that many bytes late), ``global_cached=False`` (the
global stack rerun over the step's patch alone, as transformers' cached path does), ``refresh_cross=False`` (the
decoder's cross K/V kept from the first patch), ``reading`` (the band's pre_tokens planned under another device
reading than the operators run), ``release=False`` (a finished request's blocks kept).

Deploy modes (``framework``): standalone hands each call its stack's own slots, table and kv lengths (the global
stack's at its patches), as a runner would; framework hands what the engine does (upstream cache_utils
prepare_slot_mapping / prepare_block_tables): ``block_table`` and ``slot_mapping`` dicts over the managers (one per
stack), every manager's table grown a block per byte, slots at the byte's position, kv lengths in bytes; the render
computes the global stack's rows from its table and the patch indices it is passed. What a render passed FA (kv
lengths, table) is read back through ``_Recording``, not taken from the metadata. ``run_manifest`` is `kvcache
validate`'s route: the given render's code with the CPU-sized section's constants (V108 checks its own).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from model_infer_kvcache.analyzer.files import atomic_write_text
from model_infer_kvcache.analyzer.kinds import byte_patch_section
from model_infer_kvcache.analyzer.kinds import byte_patches as bp
from model_infer_kvcache.analyzer.manifest import ByteStackPlan
from model_infer_kvcache.analyzer.measured import DEFAULT_WINDOW_READING
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS
from model_infer_kvcache.validators.npu_ops.fa_masks import causal_template
from model_infer_kvcache.validators.pipeline.report import Report

BLOCK_SIZE = 16  # small blocks: a CPU-length request spans several, so a wrong table row reads another's keys
CROSS_SLOT = 16  # the decoder cross K/V slot: cross_attn_k rows in one block of its own per request


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    new_bytes: int  # greedy bytes after the prompt
    admit: int  # the step it joins the stream at

    @property
    def length(self) -> int:
        return len(self.prompt) + self.new_bytes


@dataclass
class FaCall:
    """One FA call as the host made it: which stack and layer, for which requests at which positions, the kv_len
    and block-table rows it passed, the band."""

    stack: str
    layer: int
    requests: tuple[int, ...]
    positions: tuple[int, ...]  # the rows' positions in the stack (bytes, or patches for the global stack)
    at_bytes: tuple[int, ...]  # the byte each request was at
    kv_lens: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]
    sparse_mode: int
    pre_tokens: int


class PagedPool:
    """One stack's paged K/V: ``layers`` x [num_blocks, block_size, KV heads, head_dim], block 0 the null block
    (NaN: a read past kv_len shows), the others handed out from a shuffled free list, a table per request."""

    def __init__(self, facts: bp.StackFacts, num_blocks: int, dtype: torch.dtype, seed: int):
        self.facts = facts
        shape = (num_blocks, BLOCK_SIZE, facts.kv_heads, facts.head_dim)
        self.k = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(facts.layers)]
        self.v = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(facts.layers)]
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.start_free = len(self.free)
        self.tables: dict[int, list[int]] = {}
        self.rows: dict[int, int] = {}

    def append(self, req: int) -> int:
        """The slot of the request's next row (a new block when the last is full)."""
        table, rows = self.tables.setdefault(req, []), self.rows.get(req, 0)
        if rows % BLOCK_SIZE == 0:
            table.append(self.free.pop())
        self.rows[req] = rows + 1
        return table[rows // BLOCK_SIZE] * BLOCK_SIZE + rows % BLOCK_SIZE

    def release(self, req: int) -> None:
        for block in self.tables.pop(req, []):
            for cache in (*self.k, *self.v):
                cache[block] = float("nan")  # a released block read again shows
            self.free.append(block)
        self.rows.pop(req, None)


class _Recording:
    """A rendered module's ``torch_npu`` seen through: every op as it is, the FA calls' kv lengths and block table
    kept (``last``): what the render passed, whatever metadata it was handed."""

    FA_OPS = {kw.op: kw.kv_lens for kw in FA_KEYWORDS.values()}

    def __init__(self, module):
        self._module, self.last = module, None

    def __getattr__(self, name):
        op = getattr(self._module, name)
        if name not in self.FA_OPS:
            return op

        def call(*args, **kwargs):
            self.last = (kwargs[self.FA_OPS[name]], kwargs["block_table"])
            return op(*args, **kwargs)
        return call


class PagedAttention:
    """What a port supplies for one layer of a stack (the seam a rendered attention plugs into, the shape of the
    gqa partial's ``kv_cache_attention``): write this step's K/V [T, KV heads, head_dim] at
    ``forward_metadata.slot_mapping`` with ``npu_scatter_nd_update_``, then one packed (TND) FA call over the pool
    through ``forward_metadata.block_table`` with the stack's band."""

    def __init__(self, ops, k_cache: torch.Tensor, v_cache: torch.Tensor, stack: ByteStackPlan):
        self.ops, self.k_cache, self.v_cache = ops, k_cache, v_cache
        self.plan = dict(num_heads=stack.num_heads, num_kv_heads=stack.num_kv_heads, head_dim=stack.head_dim,
                         scale=stack.softmax_scale, sparse_mode=stack.sparse_mode, pre_tokens=stack.pre_tokens,
                         next_tokens=stack.next_tokens, masked=stack.mask != "none")

    def kv_cache_attention(self, query_states, key_states, value_states, forward_metadata):
        p = self.plan
        slots = forward_metadata.slot_mapping.view(-1, 1)
        self.ops.npu_scatter_nd_update_(self.k_cache.view(-1, p["num_kv_heads"], p["head_dim"]), slots, key_states)
        self.ops.npu_scatter_nd_update_(self.v_cache.view(-1, p["num_kv_heads"], p["head_dim"]), slots, value_states)
        num_blocks, block_size = self.k_cache.shape[:2]
        out, _ = self.ops.npu_fused_infer_attention_score(
            query_states, self.k_cache.view(num_blocks, block_size, -1), self.v_cache.view(num_blocks, block_size, -1),
            num_heads=p["num_heads"], num_key_value_heads=p["num_kv_heads"], input_layout="TND", scale=p["scale"],
            atten_mask=forward_metadata.attention_mask if p["masked"] else None, sparse_mode=p["sparse_mode"],
            pre_tokens=p["pre_tokens"], next_tokens=p["next_tokens"], block_table=forward_metadata.block_table,
            block_size=block_size, actual_seq_lengths=forward_metadata.actual_seq_lengths_cu_q,
            actual_seq_lengths_kv=forward_metadata.actual_seq_lengths_kv)
        return out


@dataclass
class RequestState:
    """What a request keeps between steps besides its pool rows and cross K/V slot: the open patch's encoder rows,
    the patcher's entropies, its completed patches and the bytes they ended at, its bytes and logits so far."""

    open_rows: list[torch.Tensor] = field(default_factory=list)
    # the patcher's next-byte entropy at each byte, a 0-d tensor in the model's dtype: transformers compares it with
    # the threshold in that dtype (patch_lengths_from_entropies: ``entropies > threshold``, the float cast to it)
    entropy: list[torch.Tensor] = field(default_factory=list)
    patches: int = 0
    cross_written: bool = False  # its cross K/V slot holds a patch's (the first patch ends at byte 0)
    ends: list[int] = field(default_factory=list)
    most_open: int = 0  # the most encoder rows its open patch held
    bytes: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class BytePatchRun:
    requests: tuple[Request, ...]
    states: dict[int, RequestState]
    calls: list[FaCall]
    pools: dict[str, PagedPool]
    pool_shapes: dict[str, list[tuple[int, ...]]]
    live_states: int  # per-request states (open-patch rows, cross K/V slots) still held after the stream
    open_patch_rows: int  # the planned bound of a request's open-patch rows (the section's, or the render's)


# Three requests (prompt bytes, greedy bytes, admitting step): different prompt lengths (past a block), late
# admits, early finishes, greedy tails
SHAPES = ((21, 4, 0), (9, 6, 2), (14, 3, 5))
STREAM_BYTES = max(n + new for n, new, _ in SHAPES)  # the longest request: it bounds the open patch's rows


def _stream(seed: int, vocab: int) -> tuple[Request, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(Request(tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()), new, admit)
                 for n, new, admit in SHAPES)


class _Host:
    def __init__(self, model, facts: bp.BytePatchFacts, ops, *, reading: str, boundary_shift: int,
                 global_cached: bool, refresh_cross: bool, rendered=None, framework: bool = False):
        self.model, self.blt, self.cfg, self.facts, self.ops = model, model.model, model.config, facts, ops
        # the manifest's section (each stack's FA shape and band) and the port: the host's own, or a render's
        self.section = {s.section: s for s in byte_patch_section.decide(facts, reading, STREAM_BYTES).stacks}
        self.rendered = rendered
        # framework mode: the engine's metadata (per manager, per byte position: ``engine_slots``), and the render
        # computes the global stack's rows itself; its FA calls are read back from what it passed (``_Recording``)
        self.framework = framework
        self.engine_slots: dict[str, dict[int, int]] = {}
        self.pools: dict[str, PagedPool] = {}
        if rendered is not None and not isinstance(rendered.torch_npu, _Recording):
            rendered.torch_npu = _Recording(rendered.torch_npu)
        self.reading, self.shift, self.global_cached, self.refresh_cross = (reading, boundary_shift, global_cached,
                                                                            refresh_cross)
        self.dtype = next(model.parameters()).dtype
        self.calls: list[FaCall] = []
        self.mask = causal_template()
        self.cross_slots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.slot_of: dict[int, int] = {}
        self.at: dict[int, int] = {}

    # ---------------------------------------------------------------- one stack's paged attention
    def _attention(self, pool: PagedPool, name: str, li: int, attn, x, emb, reqs, positions, slots):
        """The host's part of one layer's self-attention (the transformers module's projections and RoPE, o_proj
        after) around the port's part (``PagedAttention``), with the step's forward metadata."""
        from transformers.models.blt.modeling_blt import apply_rotary_pos_emb

        t, s = x.shape[0], pool.facts
        q = attn.q_proj(x).view(t, 1, s.heads, s.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(t, 1, s.kv_heads, s.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(t, 1, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *emb)
        meta = self._metadata(pool, name, reqs, slots, t)
        if self.rendered is not None:
            port = self.rendered.KVCacheBytePatchAttention(name, pool.k[li], pool.v[li])
            patch = {"patch_positions": list(positions)} if pool.facts.stack.over == bp.PER_PATCH else {}
            out = port.kv_cache_attention(q.reshape(t, s.heads, s.head_dim), k.reshape(t, s.kv_heads, s.head_dim),
                                          v.reshape(t, s.kv_heads, s.head_dim), meta, **patch)
            kv_lens, table = self.rendered.torch_npu.last  # what the render passed FA, not what it was handed
        else:
            port = PagedAttention(self.ops, pool.k[li], pool.v[li], self.section[name])
            out = port.kv_cache_attention(q.reshape(t, s.heads, s.head_dim), k.reshape(t, s.kv_heads, s.head_dim),
                                          v.reshape(t, s.kv_heads, s.head_dim), meta)
            kv_lens, table = meta.actual_seq_lengths_kv, meta.block_table
        self.calls.append(FaCall(name, li, tuple(reqs), tuple(positions), tuple(self.at[r] for r in reqs),
                                 tuple(int(x) for x in kv_lens), tuple(map(tuple, table.tolist())),
                                 port.plan["sparse_mode"], port.plan["pre_tokens"]))
        return attn.o_proj(out.reshape(t, 1, -1))

    def _metadata(self, pool: PagedPool, name: str, reqs, slots, t: int) -> SimpleNamespace:
        """The step's forward metadata for one call. Standalone: the stack's own slots, table rows and kv lengths
        (the global stack's at its patches), as its runner gives them. Framework: the engine's, per manager (a
        dict over the stacks) and per byte position: slot_mapping[stack] the byte's slot, kv lengths the bytes."""
        def table(p: PagedPool) -> torch.Tensor:
            width = max(len(p.tables[r]) for r in reqs)
            return torch.tensor([p.tables[r] + [0] * (width - len(p.tables[r])) for r in reqs], dtype=torch.int32)

        common = dict(is_prefill=False, attention_mask=self.mask, actual_seq_lengths_cu_q=list(range(1, t + 1)))
        if not self.framework:
            return SimpleNamespace(**common, slot_mapping=torch.tensor(slots, dtype=torch.int64), block_table=table(pool),
                                   actual_seq_lengths_kv=[pool.rows[r] for r in reqs])
        return SimpleNamespace(
            **common, block_table={k: table(p) for k, p in self.pools.items()},
            slot_mapping={k: torch.tensor([self.engine_slots[k][r] for r in reqs], dtype=torch.int64)
                          for k in self.pools},
            actual_seq_lengths_kv=[self.at[r] + 1 for r in reqs])

    def stack(self, pool: PagedPool, name: str, module, h, reqs, positions):
        """One stack's layers for the requests' rows ``h`` [T, 1, hidden] at ``positions``: each layer's norm,
        paged attention, MLP (BltTransformerLayer's order). Framework mode: the engine allocated the rows (a byte
        each, in every manager) before the step; the render writes them."""
        emb = module.rotary_emb(h, torch.tensor(positions).view(-1, 1))
        slots = [self.engine_slots[name][r] for r in reqs] if self.framework else [pool.append(r) for r in reqs]
        for li, layer in enumerate(module.layers):
            attn = self._attention(pool, name, li, layer.self_attn, layer.input_layernorm(h), emb, reqs, positions,
                                   slots)
            h = h + attn
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    # ---------------------------------------------------------------- cross-attention on per-request states
    def _cross(self, li: int, module, h, reqs):
        """The decoder's cross-attention layer ``li`` for one query row per request ``h`` [T, hidden] over the
        request's cross K/V slot (FA through a one-block table, kv_len cross_attn_k, sparse_mode 0 without a mask):
        its output plus ``h``, as BltCrossAttention returns it."""
        t = h.shape[0]
        heads, kv_heads, dim = module.num_heads, module.num_key_value_heads, module.head_dim
        q = module.q_proj(module.q_norm(h)).view(t, heads, dim)
        k_slots, v_slots = self.cross_slots[li]
        if self.rendered is not None:  # the render's cross-attention over the requests' slots
            out = self.rendered.KVCacheByteCrossAttention(k_slots, v_slots).cross_attention(
                q, [self.slot_of[r] for r in reqs])
            return module.o_proj(out.reshape(t, -1)) + h
        out, _ = self.ops.npu_fused_infer_attention_score(
            q, k_slots.view(k_slots.shape[0], k_slots.shape[1], -1), v_slots.view(v_slots.shape[0], v_slots.shape[1],
                                                                                   -1),
            num_heads=heads, num_key_value_heads=kv_heads, input_layout="TND", scale=module.scaling, sparse_mode=0,
            block_table=torch.tensor([[self.slot_of[r]] for r in reqs], dtype=torch.int32),
            block_size=k_slots.shape[1], actual_seq_lengths=list(range(1, t + 1)),
            actual_seq_lengths_kv=[self.cfg.cross_attn_k] * t)
        return module.o_proj(out.reshape(t, -1)) + h

    def write_cross(self, r: int, li: int, module, states) -> None:
        """Refresh request ``r``'s cross K/V slot of decoder cross layer ``li`` from the latest patch's rows."""
        k, v = self._cross_kv(module, states)
        if self.rendered is not None:  # the render's write of the patch's K/V into the request's slot
            self.rendered.KVCacheByteCrossAttention(*self.cross_slots[li]).write_patch(k, v, self.slot_of[r])
            return
        rows = torch.arange(k.shape[0]) + self.slot_of[r] * self.cross_slots[li][0].shape[1]
        for cache, new in zip(self.cross_slots[li], (k, v), strict=True):
            self.ops.npu_scatter_nd_update_(cache.view(-1, *cache.shape[2:]), rows.view(-1, 1), new)

    @staticmethod
    def _cross_kv(module, states):
        """The K/V a cross-attention module reads from ``states`` [rows, hidden]: its k_norm, k_proj, v_proj."""
        normed = module.k_norm(states)
        shape = (states.shape[0], module.num_key_value_heads, module.head_dim)
        return module.k_proj(normed).view(shape), module.v_proj(normed).view(shape)

    # ---------------------------------------------------------------- the patch boundary
    def end_patches(self, pools, states, ending: list[int], positions: dict[int, int]):
        """Pool each ending request's open patch (the encoder's cross-attention over its rows), step the global
        stack once for them (a row per completed patch) and refresh their decoder cross K/V."""
        enc, glob, dec, k = self.blt.local_encoder, self.blt.global_transformer, self.blt.local_decoder, \
            self.cfg.cross_attn_k
        cross = enc.cross_attn_layers[len(enc.cross_attn_layers) - 1]
        pooled = []
        for r in ending:
            rows = torch.cat(states[r].open_rows)  # [n, hidden]
            p = enc.patch_embedding_projection(rows.amax(0, keepdim=True)).reshape(k, -1)
            p = self._pool_cross(cross, p, self._cross_kv(cross, rows))
            pooled.append(p.reshape(1, 1, -1))
        g = glob.token_embedding_projection(torch.cat(pooled))
        if self.global_cached:
            out = self.stack(pools["global_config"], "global_config", glob, g, ending,
                             [states[r].patches for r in ending])
        else:  # transformers' cached path: the patch alone, at position 0, nothing kept
            for r in ending:
                pools["global_config"].release(r)
            out = self.stack(pools["global_config"], "global_config", glob, g, ending, [0] * len(ending))
        for i, r in enumerate(ending):
            st = states[r]
            st.patches += 1
            st.ends.append(positions[r])
            st.open_rows = []
            if st.cross_written and not self.refresh_cross:
                continue
            latest = dec.patch_embedding_projection(out[i]).reshape(k, -1)
            for li, m in enumerate(dec.cross_attn_layers):
                self.write_cross(r, li, m, latest)
            st.cross_written = True

    def _pool_cross(self, module, pooled, kv):
        """The encoder's cross-attention: the patch's k query rows over its own encoder rows (one request)."""
        heads, kv_heads, dim = module.num_heads, module.num_key_value_heads, module.head_dim
        q = module.q_proj(module.q_norm(pooled)).view(pooled.shape[0], heads, dim)
        out, _ = self.ops.npu_fused_infer_attention_score(
            q, kv[0], kv[1], num_heads=heads, num_key_value_heads=kv_heads, input_layout="TND",
            scale=module.scaling, sparse_mode=0, actual_seq_lengths=[pooled.shape[0]],
            actual_seq_lengths_kv=[kv[0].shape[0]])
        return pooled + module.o_proj(out.reshape(pooled.shape[0], -1)) + pooled

    # ---------------------------------------------------------------- one step of the stream
    def step(self, pools, states, active: list[int], feeds: dict[int, int]):
        from transformers.models.blt.modeling_blt import compute_hash_embeddings

        blt, cfg = self.blt, self.cfg
        positions = {r: len(states[r].bytes) for r in active}
        self.at = positions
        if self.framework:  # the engine: a byte's row in every manager's table, its slot per manager
            self.engine_slots = {k: {r: p.append(r) for r in active} for k, p in pools.items()}
        for r in active:
            states[r].bytes.append(feeds[r])
        pos = [positions[r] for r in active]
        byte = torch.tensor([feeds[r] for r in active]).view(-1, 1)
        if self.facts.entropy_patching:
            ph = self.stack(pools["patcher_config"], "patcher_config", blt.patcher, blt.patcher.embed_tokens(byte),
                            active, pos)
            logits = blt.patcher.lm_head(blt.patcher.norm(ph))[:, 0]
            ent = torch.distributions.Categorical(logits=logits).entropy()
            for i, r in enumerate(active):
                states[r].entropy.append(ent[i])
        embeds = torch.cat([compute_hash_embeddings(
            torch.tensor([states[r].bytes]), blt.local_encoder, blt.encoder_hash_tok_embedding,
            cfg.encoder_hash_byte_group_nb_functions, cfg.encoder_hash_byte_group_size,
            cfg.encoder_hash_byte_group_vocab)[:, -1:] for r in active])
        eh = self.stack(pools["encoder_config"], "encoder_config", blt.local_encoder, embeds, active, pos)
        ending = []
        for i, r in enumerate(active):
            st, p = states[r], positions[r]
            st.open_rows.append(eh[i])
            st.most_open = max(st.most_open, len(st.open_rows))
            if self.rendered is not None:  # the render's boundary over the request's entropies so far
                ends = self.rendered.ends_patch(st.entropy, p, len(st.open_rows))
            else:
                entropy = st.entropy[max(p - self.shift, 0)] if self.facts.entropy_patching else float("nan")
                ends = bp.ends_patch(p, entropy, len(st.open_rows), self.facts)
            if ends:
                ending.append(r)
        if ending:
            self.end_patches(pools, states, ending, positions)
        dec = blt.local_decoder
        h = eh
        emb = dec.rotary_emb(h, torch.tensor(pos).view(-1, 1))
        slots = ([self.engine_slots["decoder_config"][r] for r in active] if self.framework
                 else [pools["decoder_config"].append(r) for r in active])
        for li, layer in enumerate(dec.layers):
            if li == 0 or dec.config.cross_attn_all_layers:
                h = h + self._cross(li, dec.cross_attn_layers[li], h[:, 0], active).unsqueeze(1)
            h = h + self._attention(pools["decoder_config"], "decoder_config", li, layer.self_attn,
                                    layer.input_layernorm(h), emb, active, pos, slots)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.model.lm_head(dec.norm(h))[:, 0]
        for i, r in enumerate(active):
            states[r].logits.append(logits[i])


def _blocks_for(rows: int) -> int:
    return -(-rows // BLOCK_SIZE)


def run_byte_patches(model, facts: bp.BytePatchFacts, ops, *, seed: int = 0, requests: tuple[Request, ...] | None = None,
                     reading: str = DEFAULT_WINDOW_READING, boundary_shift: int = 0, global_cached: bool = True,
                     refresh_cross: bool = True, release: bool = True, rendered=None,
                     framework: bool = False) -> BytePatchRun:
    """Step ``requests`` (default: the seeded stream) through ``model`` on the planned paged caches with the
    operators ``ops`` (emulated torch_npu or the device's); the knobs are the negative controls' mistakes.
    ``rendered``: a rendered attention module (implementer/kinds/byte_patches.py, imported where ``import torch_npu``
    reaches ``ops``) whose ``KVCacheBytePatchAttention``, ``KVCacheByteCrossAttention`` and ``ends_patch`` replace
    the host's own."""
    reqs = requests or _stream(seed, model.config.vocab_size)
    host = _Host(model, facts, ops, reading=reading, boundary_shift=boundary_shift, global_cached=global_cached,
                 refresh_cross=refresh_cross, rendered=rendered, framework=framework)
    planned = {layer.stack.stack.section: layer.stack for layer in bp.cache_plan(facts)}
    dtype = next(model.parameters()).dtype
    blocks = 1 + sum(_blocks_for(r.length) for r in reqs)  # + the null block; the global stack needs fewer
    pools = {name: PagedPool(s, blocks, dtype, seed + i) for i, (name, s) in enumerate(planned.items())}
    host.pools = pools
    if framework and rendered is None:
        raise ValueError("framework mode runs a render (the host's own port takes a stack's rows as given)")
    # the decoder cross K/V: a slot per request (slot 0 the null slot, NaN), cross_attn_k rows, one per cross layer
    dec, width = model.model.local_decoder, -(-model.config.cross_attn_k // CROSS_SLOT) * CROSS_SLOT
    host.cross_slots = [tuple(torch.full((len(reqs) + 1, width, m.num_key_value_heads, m.head_dim), float("nan"),
                                         dtype=dtype) for _ in range(2)) for m in dec.cross_attn_layers]
    free_slots = list(range(1, len(reqs) + 1))
    random.Random(seed).shuffle(free_slots)
    start_slots = len(free_slots)
    host.slot_of = {}
    shapes = {name: [tuple(t.shape) for t in pool.k + pool.v] for name, pool in pools.items()}
    states = {i: RequestState() for i in range(len(reqs))}
    step = 0
    live = set()
    with torch.no_grad():
        while any(len(states[i].bytes) < r.length for i, r in enumerate(reqs)):
            active = [i for i, r in enumerate(reqs) if r.admit <= step and len(states[i].bytes) < r.length]
            for i in set(active) - live:  # admitted: its cross K/V slot
                host.slot_of[i] = free_slots.pop()
            live |= set(active)
            feeds = {}
            for i in active:
                st, r = states[i], reqs[i]
                n = len(st.bytes)
                feeds[i] = r.prompt[n] if n < len(r.prompt) else int(st.logits[-1].argmax())
            if active:
                host.step(pools, states, active, feeds)
            for i in list(live):
                if len(states[i].bytes) == reqs[i].length:  # finished: its blocks and states go back
                    for pool in pools.values() if release else ():
                        pool.release(i)
                    states[i].open_rows, states[i].cross_written = [], False
                    slot = host.slot_of.pop(i)
                    for pair in host.cross_slots:
                        for cache in pair:
                            cache[slot] = float("nan")
                    free_slots.append(slot)
                    live.discard(i)
            step += 1
    held = sum(1 for st in states.values() if st.open_rows or st.cross_written) + start_slots - len(free_slots)
    bound = (rendered.OPEN_PATCH_ROWS if rendered is not None
             else byte_patch_section.decide(facts, reading, STREAM_BYTES).open_patch_rows)
    return BytePatchRun(reqs, states, host.calls, pools, shapes, held, bound)


def transformers_patches(model, ids: list[int]) -> tuple[list[int], torch.Tensor | None]:
    """The bytes at which transformers' own patcher ends a patch over ``ids`` (the last byte of each patch) and its
    entropy at each byte: its patch lengths over ``ids`` plus one byte (the patcher is causal, so that byte only
    tells whether the last real byte ends one); every byte and no entropies without entropy patching."""
    cfg = model.config
    if model.model.patcher is None or cfg.patching_mode != "entropy":
        return list(range(len(ids))), None
    with torch.no_grad():
        entropy, lengths, _ = model.model.patcher(torch.tensor([[*ids, 0]]), patch_size=cfg.patch_size,
                                                  threshold=cfg.patching_threshold,
                                                  max_patch_length=cfg.max_patch_length)
    lengths = lengths[0]
    ends = (lengths[lengths > 0].cumsum(0) - 1).tolist()
    return [e for e in ends if e < len(ids)], entropy[0, :len(ids)]


# How near the threshold (in units of the entropy dtype's eps x the threshold) an entropy may lie for a boundary to
# differ between the stepped patcher and transformers' whole-sequence one: the two round differently (measured at
# bfloat16: one ulp apart across the threshold); at float64 this excuses nothing.
NEAR_THRESHOLD_EPS = 2


def rounding_boundaries(facts: bp.BytePatchFacts, ends: list[int], tf_ends: list[int],
                        entropy: torch.Tensor | None) -> list[int] | None:
    """The bytes where the run's patch ends differ from transformers' only through rounding (each such byte's entropy
    within NEAR_THRESHOLD_EPS of the threshold in the model's dtype), or None when they differ elsewhere too (or
    not at all: [])."""
    differ = sorted(set(ends) ^ set(tf_ends))
    if not differ or entropy is None or facts.threshold is None:
        return [] if not differ else None
    near = NEAR_THRESHOLD_EPS * torch.finfo(entropy.dtype).eps * abs(facts.threshold)
    return differ if all(abs(float(entropy[b]) - facts.threshold) <= near for b in differ) else None


def full_forward(model, ids: list[int], entropy: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' logits over ``ids`` in one forward without a cache: the oracle (BLT's full forward is causal);
    ``entropy``: the patcher entropies to cut patches by (transformers' own patch_lengths_from_entropies and
    process_patch_lengths over them), in place of its patcher's."""
    from transformers.models.blt.modeling_blt import BltPatcher, process_patch_lengths

    cfg, lengths = model.config, None
    if entropy is not None:
        lengths = process_patch_lengths(BltPatcher.patch_lengths_from_entropies(
            entropy[None], len(ids), cfg.patch_size, cfg.patching_threshold), cfg.max_patch_length)
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False, patch_lengths=lengths).logits[0]


def check_byte_patches(report: Report, model, facts: bp.BytePatchFacts, run: BytePatchRun, tolerance: float) -> float:
    """The run's checks (V117, V234, V309, V310, V408); returns the max |diff| of its logits."""
    plan = bp.cache_plan(facts)
    want = {}
    for layer in plan:
        s = layer.stack
        want.setdefault(s.stack.section, []).append((BLOCK_SIZE, s.kv_heads, s.head_dim))
    got = {name: [shape[1:] for shape in shapes[:len(shapes) // 2]] for name, shapes in run.pool_shapes.items()}
    report.add(f"byte patches: every stack's paged pool is its planned layers x [num_blocks, block_size, KV heads, "
               f"head_dim] ({len(plan)} layers)", "init", got == want, "" if got == want else f"{got} != {want}")

    # V234: each call reads its stack's cache at the rows the request has; the global stack exactly at the bytes
    # transformers' patcher ends a patch, one row per completed patch
    problems = []
    ends, given = {}, {}
    for i, st in run.states.items():
        ends[i], entropy = transformers_patches(model, st.bytes)
        rounded = rounding_boundaries(facts, st.ends, ends[i], entropy)
        if rounded:  # judged with the run's own boundaries, transformers' forward given them too
            report.notes.append(f"request {i}: patch boundaries at bytes {rounded} differ from transformers' "
                                f"whole-sequence patcher only where its entropy lies within {NEAR_THRESHOLD_EPS} eps "
                                f"of the threshold ({report.dtype} rounding): judged with the run's boundaries")
            ends[i], given[i] = list(st.ends), torch.stack(st.entropy)
    for call in run.calls:
        for r, at, kv in zip(call.requests, call.at_bytes, call.kv_lens, strict=True):
            expect = len([e for e in ends[r] if e <= at]) if call.stack == "global_config" else at + 1
            if kv != expect:
                problems.append(f"{call.stack} layer {call.layer} request {r} at byte {at}: kv_len {kv}, "
                                f"expected {expect}")
    for r in run.states:
        # the i-th global step of a request is its i-th patch, at the byte transformers' patcher ends it
        stepped = [c.at_bytes[c.requests.index(r)] for c in run.calls
                   if c.stack == "global_config" and c.layer == 0 and r in c.requests]
        if stepped != ends[r]:
            problems.append(f"request {r}: the global stack stepped at bytes {stepped}, transformers' patcher ends "
                            f"patches at {ends[r]}")
    # the open patch's encoder rows live in a state slot of the planned size: no patch may outgrow it
    problems += [f"request {r}: its open patch held {st.most_open} encoder rows, planned at most "
                 f"{run.open_patch_rows}" for r, st in run.states.items() if st.most_open > run.open_patch_rows]
    report.add(f"byte patches: each FA call reads its stack's own paged cache at the request's bytes (the global "
               f"stack at its completed patches, at the bytes transformers' patcher ends them) ({len(run.calls)} "
               f"calls)", "runtime", not problems, "; ".join(problems[:3]))

    # transformers casts BLT's logits to float32 (BltForCausalLM.forward: lm_head(...).float()): below float32's
    # rounding at the logits' scale no run can agree more closely, whatever its dtype
    worst, scale, margins = 0.0, 0.0, []
    for i, st in run.states.items():
        ref = full_forward(model, st.bytes, given.get(i))
        scale = max(scale, ref.abs().max().item())
        got_logits = torch.stack(st.logits)
        last = len(st.bytes) if facts.max_patch_length is None else len(st.bytes) - 1
        diff = (got_logits[:last] - ref[:last]).abs()
        # a NaN logit (a read of a released or never-written row) is no agreement: max() would drop it
        worst = max(worst, float("inf") if diff.isnan().any() else diff.max().item())
        prompt = len(run.requests[i].prompt)
        for p in range(prompt - 1, len(st.bytes) - 1):  # each greedy byte: the reference's margin over the run's pick
            mine, theirs = int(got_logits[p].argmax()), int(ref[p].argmax())
            if mine != theirs:
                margins.append((f"request {i} byte {p + 1}: {mine} vs {theirs}",
                                (ref[p, theirs] - ref[p, mine]).item()))
    tolerance = max(tolerance, torch.finfo(torch.float32).eps * scale)
    report.add(f"byte patches: logits vs transformers' full forward (each request's bytes, no cache) max |diff| <= "
               f"{tolerance:g}", "numeric", worst <= tolerance, f"max |diff| {worst:.3g}", max_abs_diff=worst)
    # as V302: logits within the bound can flip a choice whose margin is at most 2 x the bound (a near-tie)
    tie = 2 * min(worst, tolerance)
    flips = [where for where, margin in margins if margin > tie]
    ties = [where for where, margin in margins if margin <= tie]
    report.add("byte patches: greedy bytes identical to transformers' full forward", "numeric", not flips,
               "; ".join(flips[:3] + ([f"{len(ties)} near-tie(s) within 2 x the logit difference: "
                                       + ", ".join(ties[:3])] if ties else [])))

    leaks = {name: pool.start_free - len(pool.free) for name, pool in run.pools.items()
             if len(pool.free) != pool.start_free or pool.tables}
    ok = not leaks and run.live_states == 0
    report.add("byte patches: every stack's blocks back in the pool and no per-request state left after the stream",
               "release", ok, "" if ok else f"blocks held {leaks}, request states {run.live_states}")
    return worst


# ---------------------------------------------------------------- a CPU-sized BLT from any BLT config
CPU_LAYERS = 2  # layers kept per stack
# a stack's hidden size is its query heads x its head_dim here (head counts and GQA ratios kept); the stacks' head dims
# differ, as transformers' defaults do (global 128, local 64), so a stack read at another's scale shows
CPU_HEAD_DIMS = {"patcher_config": 4, "local": 8, "global_config": 16}
CPU_WINDOW = 6  # a longer window is cut so the stream's bytes (up to 25 per request) cross it
CPU_HASH_VOCAB = 100  # the hash embeddings' rows (500002 by default: ~6 x 500002 x hidden parameters)


def cpu_config(real: dict) -> tuple[dict, list[str]]:
    """``real`` (a BLT config, BltConfig.to_dict's shape) at CPU sizes, and what was cut: each stack's layers, hidden
    sizes from its head counts (the local encoder and decoder share one: the decoder reads the encoder's rows), the
    windows, the hash vocabulary. Heads, KV heads, cross_attn_k, patching mode and max_patch_length are kept."""
    import copy
    import math

    d, notes = copy.deepcopy(real), []
    heads = {s.section: d[s.section]["num_attention_heads"] for s in bp.STACKS}
    local = CPU_HEAD_DIMS["local"] * math.lcm(heads["encoder_config"], heads["decoder_config"])
    hidden = {"patcher_config": CPU_HEAD_DIMS["patcher_config"] * heads["patcher_config"], "encoder_config": local,
              "decoder_config": local, "global_config": CPU_HEAD_DIMS["global_config"] * heads["global_config"]}
    for section, size in hidden.items():
        sub = d[section]
        if sub["num_hidden_layers"] > CPU_LAYERS:
            notes.append(f"{section}.num_hidden_layers {sub['num_hidden_layers']} -> {CPU_LAYERS}")
        sub.update(num_hidden_layers=min(sub["num_hidden_layers"], CPU_LAYERS), hidden_size=size,
                   intermediate_size=2 * size)
        if "head_dim" in sub:  # to_dict writes the derived head_dim, which sizes RoPE: hidden // heads again
            sub["head_dim"] = size // heads[section]
        if section in ("encoder_config", "decoder_config"):
            sub["hidden_size_global"] = hidden["global_config"]
    for holder, name in ((d, "local_attention_window_len"), (d["patcher_config"], "sliding_window")):
        if isinstance(holder.get(name), int) and holder[name] > CPU_WINDOW:
            notes.append(f"{name} {holder[name]} -> {CPU_WINDOW}")
            holder[name] = CPU_WINDOW
    d["encoder_hash_byte_group_vocab"] = min(d.get("encoder_hash_byte_group_vocab") or CPU_HASH_VOCAB, CPU_HASH_VOCAB)
    d["encoder_config"].pop("sliding_window", None)  # BltConfig.__post_init__ copies local_attention_window_len
    return d, notes


def cpu_model(real: dict, seed: int = 0, dtype: torch.dtype = torch.float64):
    """(model, facts, notes): the CPU-sized BLT of ``real`` with seeded random weights. With entropy patching its
    threshold is re-set to the middle of its own patcher's entropies over the stream (random weights put every
    byte's entropy near ln(vocab), past any trained threshold: each byte would be a patch), so patches of several
    lengths occur; noted."""
    from transformers import BltConfig, BltForCausalLM

    d, notes = cpu_config(real)
    d = {k: v for k, v in d.items() if k not in ("transformers_version", "architectures", "model_type")}
    torch.manual_seed(seed)
    model = BltForCausalLM(BltConfig(**d)).eval().to(dtype)
    facts = bp.read_facts(model.config.to_dict(), "cpu-sized config")
    if facts.entropy_patching:
        entropies = []
        with torch.no_grad():
            for r in _stream(seed, model.config.vocab_size):
                ids = torch.tensor([r.prompt])
                entropies += model.model.patcher(ids, patch_size=model.config.patch_size, threshold=0.0)[0][0].tolist()
        s = sorted(entropies)
        threshold = (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
        notes.append(f"patching_threshold {real.get('patching_threshold')} -> {threshold:.6g} (the CPU model's median "
                     "entropy)")
        model.config.patching_threshold = threshold
        facts = bp.read_facts(model.config.to_dict(), "cpu-sized config")
    return model, facts, notes


def render_cpu(real: dict, out_dir, *, seed: int = 0, reading: str = DEFAULT_WINDOW_READING,
               deploy_mode: str = "standalone", fa_version: str = "v1") -> Path:
    """Write the implementer's render of ``real``'s CPU-sized ``byte_patches`` section (the stacks' shapes and the
    threshold the CPU model runs with, planned under the device ``reading``) for ``deploy_mode`` into ``out_dir``;
    its path."""
    from model_infer_kvcache.implementer.kinds import byte_patches as render_kind
    from model_infer_kvcache.implementer.render import ATTENTION_FILE, _environment

    _, facts, _ = cpu_model(real, seed)
    files = render_kind.render(byte_patch_section.decide(facts, reading, STREAM_BYTES), _environment(), ATTENTION_FILE,
                               fa_version=fa_version, deploy_mode=deploy_mode)
    out = Path(out_dir)
    for name, text in files.items():
        atomic_write_text(out / name, text)
    return out / ATTENTION_FILE


def validate_config(report: Report, real: dict, ops, *, seed: int = 0, rendered_dir=None, constants_dir=None,
                    **knobs) -> float:
    """The byte-stepping run of ``real``'s CPU-sized model with ``ops`` and its checks into ``report`` (notes: what
    was cut); returns the logits' max |diff|. ``rendered_dir``: a render of the CPU-sized section (``render_cpu``), or
    (``constants_dir``: that render) a render whose code runs with the CPU-sized render's constants in place of its own,
    whose attention and boundary run in place of the host's; call inside the context where ``import torch_npu``
    reaches ``ops`` (validators.npu_ops.install_emulation, or the device). ``framework``: the render is driven with
    the engine's metadata (per manager, per byte position)."""
    model, facts, notes = cpu_model(real, seed, getattr(torch, report.dtype))
    report.notes += [f"BLT at CPU sizes: {n}" for n in notes]
    rendered = None
    if rendered_dir is not None:
        from model_infer_kvcache.validators.pipeline.host_model import import_rendered

        rendered = import_rendered(rendered_dir).attention
        if constants_dir is not None:
            from model_infer_kvcache.implementer.kinds.byte_patches import CONSTANTS

            cpu = import_rendered(constants_dir).attention
            for name in CONSTANTS:
                setattr(rendered, name, getattr(cpu, name))
    try:
        run = run_byte_patches(model, facts, ops, seed=seed, rendered=rendered, **knobs)
    except Exception as exc:  # the rendered code or an operator rejected a call: a finding, not a crash
        if rendered is None:
            raise
        report.add("rendered code runs without operator errors", "runtime", False,
                   detail=f"{type(exc).__name__}: {exc}")
        return float("inf")
    if rendered is not None:
        report.add("rendered code runs without operator errors", "runtime", True)
    return check_byte_patches(report, model, facts, run, report.tolerance)


def run_manifest(report: Report, manifest, rendered_dir: str, real: dict, backend: str, ops, readings,
                 seed: int = 0) -> float:
    """``kvcache validate`` of a BLT manifest: the given render's constants against the manifest's section (V108),
    then the byte-stepping run of the given render's code with the constants of the implementer's render of the
    CPU-sized section (the manifest's deploy mode, FA version and window reading) in their place (a full-sized BLT
    does not run on CPU), inside ``ops()`` (a fresh context each time: the emulated torch_npu, or the device's) under
    the device ``readings``; returns the max |diff|. A given render that differs from the implementer's render of
    the manifest is noted."""
    import tempfile

    from model_infer_kvcache.implementer.render import ATTENTION_FILE, render_manifest
    from model_infer_kvcache.validators.npu_ops.backend import load
    from model_infer_kvcache.validators.pipeline.host_model import import_rendered

    section = manifest.byte_patches
    given = Path(rendered_dir) / ATTENTION_FILE
    if given.read_text(encoding="utf-8") != render_manifest(manifest).files[ATTENTION_FILE]:
        report.notes.append("the given render differs from the implementer's render of its manifest (its code runs "
                            "below with CPU-sized constants)")
    fields = ("num_heads", "num_kv_heads", "head_dim", "sparse_mode", "pre_tokens", "next_tokens")
    with ops():
        stacks = import_rendered(rendered_dir).attention.STACKS
    off = [f"{s.section}: {k} {stacks.get(s.section, {}).get(k)} vs {getattr(s, k)}" for s in section.stacks
           for k in fields if stacks.get(s.section, {}).get(k) != getattr(s, k)]
    off += [f"{s.section}: scale {stacks[s.section]['scale']} vs {s.softmax_scale}" for s in section.stacks
            if s.section in stacks and stacks[s.section]["scale"] != s.softmax_scale]
    report.add("rendered constants match the manifest", "init", not off and set(stacks) == {s.section for s in
                                                                                          section.stacks},
               "; ".join(off[:3]) or ("" if set(stacks) == {s.section for s in section.stacks}
                                      else f"stacks {sorted(stacks)}"))
    mode = manifest.deploy_mode.value
    with tempfile.TemporaryDirectory(prefix="kvcache-blt-") as tmp:
        render_cpu(real, tmp, seed=seed, reading=byte_patch_section.window_reading(section), deploy_mode=mode,
                   fa_version=manifest.fa.version)
        report.provenance["code_under_test"] = (
            f"the code of the render in {Path(rendered_dir).resolve()} ({mode} mode), run with the constants of the "
            "implementer's render of the manifest's byte_patches section at CPU sizes (written for the run and "
            "removed after it); its own constants checked against the manifest")
        with ops(), readings:
            return validate_config(report, real, load(backend), seed=seed, rendered_dir=rendered_dir,
                                   constants_dir=tmp, framework=mode == "framework")
