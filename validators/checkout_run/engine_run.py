"""Drive the checkout's own ExecutionEngine and Scheduler over the validation request stream, on CPU.

Everything that decides what the model sees is the checkout's code: ``InferenceConfig.from_dict``,
``ExecutionEngine.init`` (ModelWorker, CommManager, DefaultModelLoader + the model's
``load_weights``, ``get_cache_info``, ``calculate_block_num``, ``allocate_cache_tensors``,
``KVCacheManager``), ``warm_up``, ``Scheduler.add_request`` / ``run_step`` (packed prefill, decode
padded to ``batch_size_per_dp_rank``, block allocation and freeing). What a CPU cannot run is stood
in, each named in ``CPU_STANDINS`` (the report's provenance lists them).

Observation only: before every forward the blocks no live request owns (free blocks and each
group's null block) are filled with NaN, and the forward's metadata and logits are copied out.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from model_infer_kvcache.analyzer.kv_cache_spec import holds_state
from model_infer_kvcache.validators.checkout_run.recorder import ForwardSeen
from model_infer_kvcache.validators.harness.poison import manager_key, null_block_of, poison_free_blocks
from model_infer_kvcache.validators.pipeline.graph_capture import quiet_side_effects
from model_infer_kvcache.validators.pipeline.host_model import default_dtype as host_default_dtype
from model_infer_kvcache.validators.pipeline.request_stream import Scenario, Watchdog


def _gloo_name(group) -> str | None:
    """The stand-in for a group's HCCL name: a gloo group has none, but the MoE communication operators' schemas take
    ``str group_ep`` (a graph capture checks it; torch_npu's binding does too), so a group gets "gloo"; no group,
    None, as upstream's get_group_name."""
    return None if group is None else "gloo"


CPU_STANDINS = (
    "ExecutionEngine._init_device: the npu:N device is the CPU (process group: gloo, set up by the validator)",
    "executor.utils.hccl_utils.init_comm_group_by_ranks (as CommManager calls it): dist.new_group over the "
    "same ranks on gloo; a group's HCCL name (get_group_name, init_comm_group_by_ranks(return_name=True)): 'gloo' "
    "(it has none; a str, as the operators' schemas take)",
    "DefaultModelLoader.load_model: parameters created in float32 instead of bfloat16 and the loaded model "
    "cast to float32 (the CPU comparison dtype); the checkpoint's weights are bfloat16-exact; a tensor the model "
    "casts to bfloat16/float16 while it is built (a rope table precomputed in the device dtype) is made in float32 "
    "instead, as transformers' float32 reference computes it",
    "tokenizer (get_tokenizer): none; requests carry token ids (Scheduler.add_request(input_ids=...))",
    "world size 1: a one-rank gloo default process group (MoE expert-parallel paths call collectives "
    "even on one rank)",
    "get_cache_info: an entry declared in the model's published dtype (a hard-coded bfloat16 cache) is "
    "allocated in float32, the CPU comparison dtype, like the parameters; the init link judges the declared dtype",
)


@contextlib.contextmanager
def cpu_cache_dtype(model_cls, dtype: torch.dtype, published: torch.dtype, into: list):
    """While active, ``model_cls.get_cache_info()`` reports entries declared in ``published`` (the model's
    own dtype, e.g. a hard-coded ``torch.bfloat16``) in ``dtype`` instead, so the engine allocates them in the
    comparison dtype; each rewritten entry is appended to ``into`` as ``(layer, cache_name, declared)``.
    Entries in any other dtype are left as declared (the init link judges them)."""
    real = getattr(model_cls, "get_cache_info", None)
    if real is None:  # a model that owns its caches (no framework cache info): nothing to rewrite
        yield into
        return

    def get_cache_info(self, *args, **kwargs):
        info = real(self, *args, **kwargs)
        if published != dtype:
            for layer in info.layer_infos:
                for entry in layer.caches:
                    if getattr(entry, "dtype", None) == published:
                        into.append((layer.layer_idx, entry.cache_name, str(published).removeprefix("torch.")))
                        entry.dtype = dtype
        return info

    model_cls.get_cache_info = get_cache_info
    try:
        yield into
    finally:
        model_cls.get_cache_info = real


@dataclass
class StepRecord:
    index: int
    is_prefill: bool
    request_ids: list[int]
    positions: list[int]  # the position whose logits each request got this step
    logits: torch.Tensor  # [len(request_ids), vocab], the rows of live requests
    padded_rows: int  # rows the engine added to reach batch_size_per_dp_rank
    block_table: dict  # group key -> table rows of the live requests (copy)
    slot_mapping: dict  # group key -> slots (copy)
    kv_lens: list[int]
    cu_kv_lens: list[int] = field(default_factory=list)  # the same lengths as prefix sums (TND prefill form)
    poisoned: dict = field(default_factory=dict)
    # (layer, state entry name, group) -> the blocks of that recurrent-state tensor the forward changed
    state_writes: dict = field(default_factory=dict)


@dataclass
class EngineRun:
    engine: object
    scheduler: object
    steps: list[StepRecord] = field(default_factory=list)
    sequences: dict[int, list[int]] = field(default_factory=dict)
    prompt_len: dict[int, int] = field(default_factory=dict)


def infer_config_dict(name: str, model_path: str, tp: int, scenario: Scenario, block_size: int,
                      max_new_tokens: int, layout: dict[str, int] | None = None, exe_mode: str = "eager",
                      dynamic_graph: bool = True) -> dict:
    """The yaml dictionary of a tiny CPU run (the shape of models/*/config/*.yaml); ``layout``: parallel sizes
    taken from the model's own yamls (``shipped_layout``); ``exe_mode`` npugraph_ex: decode compiled as the engine
    compiles it (its yaml defaults: dynamic graph, no cache compile), captured by ``graph_backend``."""
    longest = max(n for n, _ in scenario.first + scenario.late)
    graph = {"enable_dynamic_graph": dynamic_graph, "enable_cache_compile": False} if exe_mode != "eager" else {}
    return {
        "model_config": {"model_name": name, "model_path": model_path, "exe_mode": exe_mode, "with_ckpt": True,
                         "platform_version": "A3", "enable_weight_nz": False, **graph},
        "data_config": {"dataset": "default", "input_truncated_len": longest},
        "parallel_config": {"world_size": tp, "attn_tp_size": tp, "moe_tp_size": tp, "embed_tp_size": 1,
                            "lmhead_tp_size": 1, **(layout or {})},
        "scheduler_config": {"batch_size": engine_batch_size(scenario.max_concurrency, tp),
                             "max_new_tokens": max_new_tokens,
                             "block_size": block_size},
    }


@contextlib.contextmanager
def graph_backend(recorder):
    """The engine's ``torch.compile(..., backend="npugraph_ex")`` and its ge_graph backend
    (``torchair.get_npu_backend``, executor/utils/graph_utils.py) reach ``recorder.backend``
    (graph_capture.CaptureRecorder) inside the block; the Dynamo settings the engine changes
    (``inline_inbuilt_nn_modules``) and its compile cache are restored on exit."""
    from torch._dynamo.backends import registry

    with warnings.catch_warnings():  # newer torch ignores the flag and warns when it is read
        warnings.simplefilter("ignore", FutureWarning)
        saved_inline = torch._dynamo.config.inline_inbuilt_nn_modules
    had = {table: getattr(registry, table).get("npugraph_ex") for table in ("_BACKENDS", "_COMPILER_FNS")}
    from model_infer_kvcache.validators.standins.device import GRAPH_BACKENDS

    registry._lazy_import()  # torch's own backends first: the lazy import would not run once a name is known
    registry._BACKENDS["npugraph_ex"] = None
    registry._COMPILER_FNS["npugraph_ex"] = recorder.backend
    GRAPH_BACKENDS.append(recorder.backend)  # ge_graph: torchair.get_npu_backend()
    torch._dynamo.reset()
    try:
        with quiet_side_effects():
            yield recorder
    finally:
        GRAPH_BACKENDS.remove(recorder.backend)
        for table, value in had.items():
            if value is None:
                getattr(registry, table).pop("npugraph_ex", None)
            else:
                getattr(registry, table)["npugraph_ex"] = value
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch._dynamo.config.inline_inbuilt_nn_modules = saved_inline
        torch._dynamo.reset()


def engine_batch_size(concurrency: int, tp: int) -> int:
    """The engine's ``batch_size`` (= ``batch_size_per_dp_rank``: attention TP spans every rank, one DP rank): the
    stream's concurrency rounded up to a multiple of the attention TP, as every shipped launch yaml has it (a model
    that shards its decode rows over the attention TP ranks refuses anything else: bailing_2_5's model_setting.py).
    The driver, not this size, decides when requests arrive (``drive``), so the stream is the same; the pools hold
    the extra rows' blocks."""
    return -(-concurrency // tp) * tp


def shipped_layout(config_dir: Path, tp: int) -> dict[str, int]:
    """Parallel sizes the run takes from the model's own launch yamls (``config_dir``: the model folder's
    ``config/``) instead of its defaults (``o_proj_tp_size`` 1, ``moe_tp_size`` = attention TP), read from the yamls
    that run attention TP over every rank (``attn_tp_size == world_size > 1``, as the validator does), when all of
    them agree: ``o_proj_tp_size`` equal to the attention TP (bailing_2_5's model_setting.py refuses anything else),
    ``moe_tp_size`` 1, i.e. the MoE expert-parallel over every rank (bailing_2_5's prefill MoE exchanges tokens
    over its expert-parallel group, which is no group at all when ``moe_tp_size`` is the world size). None of the
    other snapshot models' yamls agree on either, so their runs keep the defaults."""
    import yaml

    layouts = []
    for path in sorted(config_dir.glob("*.yaml")):
        try:
            parallel = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("parallel_config") or {}
        except (yaml.YAMLError, OSError, AttributeError):
            continue
        world, attn = parallel.get("world_size", 1), parallel.get("attn_tp_size", 1)
        if isinstance(world, int) and world > 1 and attn == world:
            layouts.append(parallel)
    out: dict[str, int] = {}
    if layouts and all(p.get("o_proj_tp_size", 1) == p["attn_tp_size"] for p in layouts):
        out["o_proj_tp_size"] = tp
    if layouts and all(p.get("moe_tp_size", 1) == 1 for p in layouts):
        out["moe_tp_size"] = 1
    return out


HALF_DTYPES = (torch.bfloat16, torch.float16)


class HalfDtypesAs(torch.overrides.TorchFunctionMode):
    """While active, every half dtype a call names (``dtype=torch.bfloat16`` of a factory, ``Tensor.to(bfloat16)``)
    is ``dtype`` instead. While any model is built: a table it precomputes in the device dtype (gemma_4's cos/sin
    buffers) would otherwise keep bfloat16 rounding after the loaded model is cast to the comparison dtype, and
    differ from the float32 reference by that rounding, not by any code. While a model that owns its caches
    (Legacy) is built and runs: it allocates them, and casts for its operators, in the device dtype by hand."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") in HALF_DTYPES:
            kwargs = {**kwargs, "dtype": self.dtype}
        if func is torch.Tensor.to and any(_half(a) for a in args[1:]):
            # (a tensor argument is never compared with a dtype: `tensor in HALF_DTYPES` is a tensor comparison, which
            # a graph capture of the step refuses)
            args = tuple(self.dtype if _half(a) else a for a in args)
        return func(*args, **kwargs)


def _half(value) -> bool:
    return isinstance(value, torch.dtype) and value in HALF_DTYPES


@contextlib.contextmanager
def cpu_engine_patches(dtype: torch.dtype):
    """Apply CPU_STANDINS to the checkout's freshly imported modules (undone on exit)."""
    import executor.core.config.comm_manager as comm_manager
    import executor.core.engine.execution_engine as engine_mod
    import executor.model_loader.default_loader as loader_mod
    import torch.distributed as dist

    saved = [(comm_manager, "init_comm_group_by_ranks"), (comm_manager, "get_group_name"), (engine_mod, "get_tokenizer"),
             (loader_mod, "set_default_torch_dtype"), (loader_mod.DefaultModelLoader, "load_model")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in saved]

    def gloo_group(ranks, global_rank=0, group_name="", hccl_buffer_size=None, group_type=None,
                   platform_version="A3", return_name=False):
        group = dist.new_group(sorted(ranks), backend="gloo")
        return (group, _gloo_name(group)) if return_name else group

    def default_dtype(_ignored):  # the loader's set_default_torch_dtype, whatever dtype the model config names
        return host_default_dtype(dtype)

    real_load = loader_mod.DefaultModelLoader.load_model

    def load_model(self, *args, **kwargs):
        with HalfDtypesAs(dtype):
            model = real_load(self, *args, **kwargs)
        return model.to(dtype)

    comm_manager.init_comm_group_by_ranks = gloo_group
    comm_manager.get_group_name = lambda group, global_rank: _gloo_name(group)
    engine_mod.get_tokenizer = lambda *a, **k: types.SimpleNamespace(eos_token_id=None, pad_token_id=None)
    loader_mod.set_default_torch_dtype = default_dtype
    loader_mod.DefaultModelLoader.load_model = load_model
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


@contextlib.contextmanager
def single_rank_group():
    """A one-rank gloo default group for a single-process run (none is created when one exists)."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="kvcache-gloo-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def cpu_engine_class():
    from executor.core.engine import execution_engine as engine_mod

    class CpuExecutionEngine(engine_mod.ExecutionEngine):
        def _init_device(self):
            self.device = torch.device("cpu")
            self.sampler = engine_mod.Sampler(self.device)

    return CpuExecutionEngine


def _tensors_by_group(cache_info) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for layer in cache_info.layer_infos:
        for entry in layer.caches:
            t = getattr(entry, "tensor", None)
            if isinstance(t, torch.Tensor) and t.numel():
                out.setdefault(entry.group_key, []).append(t)
    return out


def state_entries(cache_info) -> list[tuple[int, str, str, torch.Tensor]]:
    """(layer, entry name, group, tensor) of every recurrent-state entry (attn_type Mamba: [blocks, *shape])."""
    return [(layer.layer_idx, e.cache_name, e.group_key, e.tensor) for layer in cache_info.layer_infos
            for e in layer.caches if holds_state(e.attn_type) and isinstance(getattr(e, "tensor", None), torch.Tensor)
            and e.tensor.numel()]


def changed_blocks(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    """Blocks (dim 0) whose contents differ; a poisoned (NaN) element left NaN is unchanged."""
    same = (before == after) | (before.isnan() & after.isnan())
    return torch.nonzero(~same.reshape(same.shape[0], -1).all(dim=1)).reshape(-1).tolist()


def cache_bytes(cache_info) -> int:
    return sum(t.numel() * t.element_size() for ts in _tensors_by_group(cache_info).values() for t in ts)


def pool_usage(manager) -> dict[str, dict[str, int]]:
    out = {}
    for m in manager.single_type_managers:
        key = manager_key(m)
        owned = {b for blocks in m.req_to_blocks.values() for b in blocks if b != null_block_of(m)}
        out[key] = {"total": m.block_pool.num_blocks, "free": m.block_pool.get_num_free_blocks(), "used": len(owned)}
    return out


def build_engine(infer_config, model_cls, config_cls):
    """The engine after ``init`` (model loaded, cache allocated); ``warm_up`` runs under ``declared_caches``."""
    engine = cpu_engine_class()(infer_config)
    engine.init(config_cls, model_cls, None)
    return engine


@contextlib.contextmanager
def load_coverage(model_cls, into: dict):
    """Record what the model's ``load_weights`` reports as loaded (``into['loaded']``) and the parameters
    it has (``into['params']``): DefaultModelLoader ignores the difference, the init link does not."""
    had = "load_weights" in model_cls.__dict__
    real = model_cls.load_weights

    def load_weights(self, weights):
        loaded = real(self, weights)
        into["loaded"] = set(loaded) if loaded is not None else None
        into["params"] = {name for name, _ in self.named_parameters()}
        return loaded

    model_cls.load_weights = load_weights
    try:
        yield into
    finally:
        if had:
            model_cls.load_weights = real
        else:
            del model_cls.load_weights


@contextlib.contextmanager
def declared_caches(engine):
    """Tell the emulated writers which tensors are paged caches and where each group's null block is:
    the engine's padded decode rows (and warm-up) repeat slots there, which the device allows."""
    from model_infer_kvcache.validators.npu_ops import paged_caches

    manager = engine.kvcache_manager
    groups = _tensors_by_group(manager.cache_info)
    with contextlib.ExitStack() as stack:
        for m in manager.single_type_managers:
            key = manager_key(m)
            stack.enter_context(paged_caches(groups.get(key, []), null_block=null_block_of(m)))
        yield


@contextlib.contextmanager
def observed_forwards(engine, recorder):
    """Record each of the model's forwards (warm-up, stream, release run) on ``recorder``: its kind and
    the forward metadata the engine built, which the runtime checks judge the calls against."""
    workers = [engine.main_worker]
    mtp = getattr(getattr(engine, "mtp_worker", None), "mtp_model_worker", None)
    if mtp is not None:
        workers.append(mtp)
    saved = [(w, w.inference) for w in workers]

    def observing(real):
        def inference(*args, **kwargs):  # (model_inputs, is_prefill, is_mtp=False), positional or keyword
            def arg(i, name, default=None):
                return kwargs[name] if name in kwargs else args[i] if len(args) > i else default

            recorder.forwards.append(ForwardSeen.of(arg(0, "model_inputs"), arg(1, "is_prefill"),
                                                    arg(2, "is_mtp", False)))
            return real(*args, **kwargs)

        return inference

    try:
        for worker, real in saved:
            worker.inference = observing(real)
        yield
    finally:
        for worker, real in saved:
            worker.inference = real


def drive(engine, scenario: Scenario, seed: int, recorder) -> EngineRun:
    """The request stream through the real Scheduler: the first wave but its last request at once, the
    last one two decode steps later (a prefill between decodes, a later finish than the others), the
    late requests when the first wave finishes (admitted into the freed blocks, decoded beside the one
    still running, in batches the engine pads to ``batch_size_per_dp_rank``). ``recorder`` observes the
    engine's forwards (``observed_forwards``): each step keeps its main forward's metadata."""
    from executor.core.scheduler import Scheduler

    sched = Scheduler(tokenizer=None, config=engine.infer_config.scheduler_config,
                      input_truncated_len=engine.infer_config.data_config.input_truncated_len)
    run = EngineRun(engine, sched)
    manager = engine.kvcache_manager  # None: Legacy, the model owns its caches
    groups = _tensors_by_group(manager.cache_info) if manager is not None else {}
    states = state_entries(manager.cache_info) if manager is not None else []
    real_forward = engine.forward_batch
    dog = scenario.watchdog("checkout request stream")

    def forward_batch(batch):
        recorder.step = len(run.steps)
        poisoned = poison_free_blocks(manager, groups) if manager is not None else {}
        ids = [r.request_id for r in batch.requests]
        positions = [(r.prompt_tokens if batch.is_prefill else r.get_seq_len()) - 1 for r in batch.requests]
        first = len(recorder.forwards)
        before = [t.clone() for *_, t in states]  # which state blocks the step writes (check_state_blocks)
        with dog.step(len(run.steps), ids):
            out = real_forward(batch)
        state_writes = {(layer, name, group): changed_blocks(b, t)
                        for (layer, name, group, t), b in zip(states, before, strict=True)}
        seen = next((f for f in recorder.forwards[first:] if not f.is_mtp), None)  # the main model's forward
        if seen is None:
            raise RuntimeError("drive() needs the engine's forwards observed (observed_forwards(engine, recorder))")
        logits = out["logits"].reshape(out["logits"].shape[0], -1)
        n = len(ids)
        rows = logits.shape[0]
        run.steps.append(StepRecord(
            len(run.steps), batch.is_prefill, ids, positions, logits[:n].detach().double().clone(),
            rows - n, seen.block_table, seen.slot_mapping, seen.kv_lens, seen.cu_kv_lens,
            {k: len(v) for k, v in poisoned.items()}, state_writes))
        if batch.is_prefill:
            run.prompt_len.update({r.request_id: r.prompt_tokens for r in batch.requests})
        return out

    engine.forward_batch = forward_batch
    try:
        prompts = scenario.prompts(seed)
        first = len(scenario.first)
        wave, held, late = prompts[:first - 1], prompts[first - 1:first], prompts[first:]
        if manager is None:  # Legacy: one prefill of the whole batch (its caches are rows of that batch)
            wave, held, late = prompts, [], []
        for ids, _ in wave:
            sched.add_request(prompt="", input_ids=torch.tensor(ids, dtype=torch.long))
        decodes = 0
        while sched.has_work() or held or late:
            if held and (decodes >= 2 or not sched.has_work()):  # never wait on an empty scheduler
                for ids, _ in held:
                    sched.add_request(prompt="", input_ids=torch.tensor(ids, dtype=torch.long))
                held = []
            if late and (sched.finished_requests or not sched.has_work()) and not held:
                for ids, _ in late:
                    sched.add_request(prompt="", input_ids=torch.tensor(ids, dtype=torch.long))
                late = []
            if not sched.has_work():
                continue
            before = len(run.steps)
            if not sched.run_step(engine):
                raise RuntimeError("the Scheduler had work but scheduled no batch (the pool cannot hold the stream)")
            if not run.steps[before].is_prefill:
                decodes += 1
        for rid, req in sched.finished_requests.items():
            run.sequences[rid] = req.get_all_token_ids()
    finally:
        recorder.step = -1  # later forwards (release run) are not the stream's
        engine.forward_batch = real_forward
    return run



def drive_sequential(engine, count: int, seed: int, vocab: int, dog: Watchdog) -> int:
    """``count`` requests one after another through a fresh Scheduler (the release link's long run)."""
    from executor.core.scheduler import Scheduler

    sched = Scheduler(tokenizer=None, config=engine.infer_config.scheduler_config,
                      input_truncated_len=engine.infer_config.data_config.input_truncated_len)
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        ids = torch.randint(0, vocab, (8 + (i * 37) % 120,), generator=g)
        sched.add_request(prompt="", input_ids=ids)
        while sched.has_work():
            with dog.step(f"release request {i}", [i]):
                if not sched.run_step(engine):
                    raise RuntimeError("the Scheduler had work but scheduled no batch")
    return count
