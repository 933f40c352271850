"""A standalone folder's own runner, driven on CPU as its entry script drives it.

What runs is the folder's code: the settings hooks of ``models/model_setting.py`` on the yaml, the runner's
``__init__`` and ``init_model`` (its loader builds the model from the tiny config.json), and ``model_generate``
twice on the same runner (warm-up, then the run, as ``infer.py`` calls it), with the runner's own
``model_input_prepare`` (its cache allocation), ``model_inference`` and ``model_output_process`` (its kv_len and
position bookkeeping). What a CPU cannot run is replaced, and each replacement is listed (``Drive.replaced``).
The recompute oracle runs in the same scope: each row's whole prefix through a fresh prefill of the same model.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
from model_infer_kvcache.validators.runner_run.folder import StandaloneFolder

# The tiny model: small enough for CPU, the published head grouping kept (GQA stays GQA).
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 512}
# What a kvcache render in the folder bakes in as constants: kept at the config's values (as tiny_model keeps them).
RENDERED_GEOMETRY = ("num_attention_heads", "head_dim", "num_key_value_heads")


def rendered_files(folder: Path) -> list[Path]:
    """The folder's files rendered by kvcache (its header line), e.g. a migrated runner's kvcache_attention.py."""
    from model_infer_kvcache.validators.pipeline.provenance import read_header

    found = []
    for path in sorted(folder.rglob("*.py")):
        try:
            if read_header(path) is not None:
                found.append(path)
        except (OSError, UnicodeDecodeError):  # not a render: kvcache writes utf-8
            continue
    return found


PAD_ID = 0


@dataclass(frozen=True)
class Scenario:
    prompts: tuple[int, ...] = (40, 17, 48, 29)  # unequal lengths in one batch: the runner pads them
    max_new_tokens: int = 6
    seed: int = 0
    # A runner serving requests (``model_generate(prompts, max_new_tokens=[one per prompt])``): more requests than
    # rows and unequal budgets, so requests finish early and waiting ones take the freed rows.
    stream_prompts: tuple[int, ...] = (40, 17, 48, 29, 23, 35)
    stream_budgets: tuple[int, ...] = (6, 2, 5, 3, 4, 6)
    stream_rows: int = 3

    @property
    def input_max_len(self) -> int:
        return max(self.prompts + self.stream_prompts)


@dataclass
class Step:
    is_prefill: bool
    logits: torch.Tensor  # [batch, vocab]: the row's next-token logits
    # decode: per row, the sequence positions the step's cache writes target (a contiguous writer's indices; a
    # paged writer's: the positions whose cache changed)
    written: list[list[int]] | None = None
    cache_ptrs: tuple[int, ...] = ()  # storages of the caches the step used: allocated once, kept by every step
    # a serving runner's step (Drive.serving): the rows it built the metadata for, the prompt lengths of a prefill,
    # the packed token ids and positions it fed, each paged writer call's slots, and where in
    # the runner the metadata was built
    rows: list[int] | None = None
    prompt_lens: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[list[int]] = field(default_factory=list)
    site: str = ""


@dataclass
class Drive:
    steps: list[Step] = field(default_factory=list)  # the judged model_generate
    warm_steps: list[Step] = field(default_factory=list)  # the warm-up model_generate before it
    caches: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)  # (name, shape, dtype) allocated
    write_sites: set[str] = field(default_factory=set)  # file:line of the cache writes
    step_writes: list[dict] = field(default_factory=list)  # the current step's writer calls (op, per-row indices)
    driven: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    kv_len_source: str = ""  # the runner function that sets the next step's kv_len
    cache_source: str = ""  # the runner function that allocates (or keeps) the caches
    # A runner serving requests over rows of a runner-owned paged cache (the standalone render's
    # KVCacheRunnerMixin): its model_generate takes one max_new_tokens per prompt.
    serving: bool = False
    budgets: list[int] = field(default_factory=list)
    rows: int = 0  # the rows (batch_size) the runner serves
    block_table: torch.Tensor | None = None  # the runner's whole table after the run: where each row's blocks are
    block_size: int = 0
    build_metadata: object = None  # the runner's own metadata builder, unwrapped (the oracle's fresh prefills)
    input_keys: dict = field(default_factory=dict)  # model_inputs key -> "ids" / "positions" / "metadata" / value


class _TokenIds:
    """The tokenizer stand-in: prompts are token-id lists; padding as the runner asks (right, to max_length)."""

    pad_token_id = PAD_ID
    eos_token_id = 1
    pad_token = "<pad>"
    eos_token = "<eos>"

    def __call__(self, prompts, max_length=None, **kwargs):
        n = max([max_length or 0] + [len(p) for p in prompts])
        ids = torch.full((len(prompts), n), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
            mask[i, :len(p)] = 1
        batch = types.SimpleNamespace(input_ids=ids, attention_mask=mask)
        batch.to = lambda device: batch
        return batch

    def decode(self, ids, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids)

    def batch_decode(self, seqs, **kwargs) -> list[str]:
        return [self.decode(s) for s in seqs]


def tiny_config(sf: StandaloneFolder, config_json: str | None) -> tuple[type, object, list[str]]:
    """The folder's config class read from ``config_json`` (its defaults without one), shrunk: (class, config,
    notes). Import inside ``runner_scope``."""
    module = importlib.import_module(f"models.{sf.config_file.stem}")
    cls = getattr(module, sf.config_class)
    data = json.loads(Path(config_json).read_text(encoding="utf-8")) if config_json else {}
    config = cls(**data)
    notes = [f"config: {sf.config_class} ({sf.config_file.name}) " + (f"reading {config_json}" if config_json
                                                                      else "at its defaults")]
    heads, kv = getattr(config, "num_attention_heads", 1), getattr(config, "num_key_value_heads", None)
    rendered = rendered_files(sf.folder)
    kept = RENDERED_GEOMETRY if rendered else ()
    for name, value in TINY.items():
        if hasattr(config, name) and name not in kept:
            setattr(config, name, value)
    if kv is not None and not kept:  # keep the grouping: MHA stays MHA, GQA keeps fewer KV heads, MQA one
        config.num_key_value_heads = TINY["num_attention_heads"] if kv == heads else (1 if kv == 1 else 2)
    if kept:
        notes.append(f"attention geometry kept ({', '.join(kept)}): the folder's kvcache render "
                     f"({', '.join(p.name for p in rendered)}) bakes it in")
    config.torch_dtype = "float32"
    notes.append("tiny model: " + ", ".join(f"{k}={getattr(config, k)}" for k in (*TINY, "num_key_value_heads")
                                            if hasattr(config, k)) + "; float32")
    return cls, config, notes


@contextlib.contextmanager
def runner_scope(sf: StandaloneFolder, drive: Drive):
    """The checkout importable (checkout_run's scope: stand-ins, isolation), the folder on sys.path as its entry
    script runs, the runner module (or its edited copy) importable under its own name, the device replaced."""
    from model_infer_kvcache.validators.checkout_run.engine_run import single_rank_group
    from model_infer_kvcache.validators.checkout_run.scope import checkout_scope

    # the writers are wrapped before the emulation is installed: the torch_npu stand-in binds the ops on entry
    with _write_sites(sf, drive), checkout_scope(sf.root) as scope, single_rank_group():
        sys.path.insert(0, str(sf.folder))
        importlib.invalidate_caches()
        drive.replaced += scope.standins
        try:
            if sf.runner_file.parent != sf.folder:  # --runner-file: the copy stands under the shipped name
                spec = importlib.util.spec_from_file_location(sf.runner_module, sf.runner_file)
                module = importlib.util.module_from_spec(spec)
                sys.modules[sf.runner_module] = module
                spec.loader.exec_module(module)
            import executor.model_runner as base

            saved = (base.ModelRunner.init_device, base.ModelRunner.init_tokenizer)
            base.ModelRunner.init_device = lambda self: setattr(self, "device", torch.device("cpu"))
            base.ModelRunner.init_tokenizer = lambda self: setattr(self, "tokenizer", _TokenIds())
            drive.replaced += ["ModelRunner.init_device: the npu:N device is the CPU (no HCCL group: one rank)",
                               "ModelRunner.init_tokenizer: a token-id tokenizer (prompts are token ids, padded "
                               "right to max_length as the runner asks)"]
            try:
                yield
            finally:
                base.ModelRunner.init_device, base.ModelRunner.init_tokenizer = saved
        finally:
            sys.modules.pop(sf.runner_module, None)
            for name, mod in list(sys.modules.items()):  # the folder's own top-level modules (kvcache_runner.py)
                if str(getattr(mod, "__file__", "") or "").startswith(str(sf.folder)):
                    del sys.modules[name]
            if str(sf.folder) in sys.path:
                sys.path.remove(str(sf.folder))


def _settings(sf: StandaloneFolder, scenario: Scenario, model_path: Path, drive: Drive) -> dict:
    rows = scenario.stream_rows if drive.serving else len(scenario.prompts)
    new_tokens = max(scenario.stream_budgets) if drive.serving else scenario.max_new_tokens
    import yaml

    settings = yaml.safe_load(sf.yaml.read_text(encoding="utf-8"))
    settings["model_path"] = str(model_path)
    settings["exe_mode"] = "eager"
    model_config = settings.setdefault("model_config", {})
    model_config.update(with_ckpt=False, tokenizer_mode="default", enable_profiler=False)
    data = settings.setdefault("data_config", {})
    data.update(dataset="default", input_max_len=scenario.input_max_len, max_new_tokens=new_tokens, batch_size=rows)
    drive.replaced.append(f"{sf.yaml.name}: model_path -> the tiny config's folder, exe_mode eager (graph mode is not "
                          f"validated here), with_ckpt False (the folder's DummyModelLoader builds the model), "
                          f"input_max_len {scenario.input_max_len}, max_new_tokens {new_tokens}, batch_size {rows}")
    if sf.settings_hooks:
        setting = importlib.import_module("models.model_setting")
        for hook in sf.settings_hooks:  # in the entry script's order: check_vars, then update_vars
            getattr(setting, hook)(1, settings)
            drive.driven.append(f"models/model_setting.py {hook}(world_size=1, settings) ({sf.entry_script.name})")
    return settings


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with the spread of a trained model: the dummy loader's uniform +-1e-3 makes every logit
    near-uniform, where a wrong position or a stale row would change nothing measurable."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


def module_caches(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Caches a runner hands to the model's layers (the standalone render's ``k_cache`` / ``v_cache`` attributes):
    every non-empty tensor attribute named ``*cache`` of a module, in module order."""
    found = []
    for name, module in model.named_modules():
        for attr, value in sorted(vars(module).items()):
            if attr.endswith("cache") and isinstance(value, torch.Tensor) and value.numel():
                found.append((f"{name}.{attr}", value))
    return found


def _cache_tensors(past) -> list[torch.Tensor]:
    if past is None:
        return []
    if isinstance(past, torch.Tensor):
        return [past]
    if isinstance(past, (tuple, list)):
        return [t for item in past for t in _cache_tensors(item)]
    return []


def _written_positions(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[list[int]]:
    """Per batch row, the sequence positions (dim 1 of a [batch, seq, ...] cache) any cache tensor changed at."""
    rows: list[set[int]] = []
    for b, a in zip(before, after, strict=True):
        if a.dim() < 2 or a.shape != b.shape:
            continue
        changed = (a != b).reshape(a.shape[0], a.shape[1], -1).any(-1)
        while len(rows) < a.shape[0]:
            rows.append(set())
        for r in range(a.shape[0]):
            rows[r] |= set(torch.nonzero(changed[r]).flatten().tolist())
    return [sorted(r) for r in rows]


def _targeted(writes: list[dict]) -> list[list[int]] | None:
    """Per row, the positions the step's contiguous writers target (None when a paged writer or none wrote)."""
    if not writes or any(w["paged"] or w["indices"] is None for w in writes):
        return None
    rows: list[set[int]] = [set() for _ in writes[0]["indices"]]
    for w in writes:
        for r, positions in enumerate(w["indices"][:len(rows)]):
            rows[r] |= {int(p) for p in positions}
    return [sorted(r) for r in rows]


def _folder_frame(sf: StandaloneFolder, frame, depth: int):
    """The innermost of ``depth`` frames from ``frame`` outwards whose code lies in the folder (or is the runner
    copy). Frames are walked, not ``inspect.stack()``-ed: that reads every frame's source, at every cache write."""
    folder, runner = str(sf.folder), str(sf.runner_file)
    while frame is not None and depth > 0:
        path = str(Path(frame.f_code.co_filename).resolve())
        if path.startswith(folder) or path == runner:
            return frame
        frame, depth = frame.f_back, depth - 1
    return None


@contextlib.contextmanager
def _write_sites(sf: StandaloneFolder, drive: Drive):
    """Every cache-writer call: its file:line inside the folder (what a wrong position is reported at) and, for a
    contiguous writer (``scatter_update_``: ``indices`` per row), the positions it targets. Read from the call, not
    from the values: the run repeats the warm-up's prompts, so a right write stores what is already there."""
    from model_infer_kvcache.analyzer.operators.writers import CACHE_WRITERS
    from model_infer_kvcache.validators.npu_ops import emulated

    saved = dict(emulated.OPS)

    def wrap(name, fn):
        writer = CACHE_WRITERS[name]
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            site = _folder_frame(sf, sys._getframe(1), 7)
            if site is not None:
                drive.write_sites.add(f"{Path(site.f_code.co_filename).name}:{site.f_lineno}")
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:  # the operator reports the bad call itself
                bound = {}
            index = bound.get(writer.index)
            drive.step_writes.append({"op": name, "paged": writer.paged,
                                      "indices": index.reshape(index.shape[0], -1).tolist()
                                      if isinstance(index, torch.Tensor) and index.dim() >= 1 else None,
                                      "slots": index.reshape(-1).tolist()
                                      if writer.paged and isinstance(index, torch.Tensor) else None})
            return fn(*args, **kwargs)
        return call

    for name in CACHE_WRITERS:
        if name in emulated.OPS:
            emulated.OPS[name] = wrap(name, saved[name])
    try:
        yield
    finally:
        emulated.OPS.clear()
        emulated.OPS.update(saved)


def prompts_of(scenario: Scenario, vocab: int, serving: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(scenario.seed + 7)
    return [torch.randint(2, vocab, (n,), generator=g).tolist()
            for n in (scenario.stream_prompts if serving else scenario.prompts)]


def serves_requests(runner_cls: type) -> bool:
    """A runner whose ``model_generate`` takes ``max_new_tokens`` (one per prompt) and builds its steps with the
    standalone render's ``_build_forward_metadata``: it admits and finishes requests over its rows."""
    generate = inspect.signature(runner_cls.model_generate).parameters
    return "max_new_tokens" in generate and callable(getattr(runner_cls, "_build_forward_metadata", None))


def _caller_site(sf: StandaloneFolder) -> str:
    """file:line (and function) of the innermost frame inside the folder calling into kvcache's spies."""
    frame = _folder_frame(sf, sys._getframe(2), 8)
    return "?" if frame is None else \
        f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"


def _spy_metadata(sf: StandaloneFolder, runner, drive: Drive) -> dict:
    """Wrap the runner's metadata builder: each step's rows, prompt lengths and call site."""
    real = runner._build_forward_metadata
    drive.build_metadata = real
    pending: dict = {}

    def spy(rows, prompt_lens=None):
        meta = real(rows, prompt_lens)
        pending.update(rows=[int(r) for r in rows], prompt_lens=None if prompt_lens is None else
                       [int(n) for n in prompt_lens], site=_caller_site(sf))
        return meta
    runner._build_forward_metadata = spy
    return pending


def _input_keys(model_inputs: dict) -> dict:
    """How the oracle rebuilds the runner's model inputs for a fresh prefill: which key holds what."""
    keys = {}
    for key, value in model_inputs.items():
        keys[key] = ("ids" if key == "input_ids" else "positions" if key == "position_ids" else
                     "metadata" if hasattr(value, "slot_mapping") and hasattr(value, "block_table") else value)
    return keys


def drive_runner(sf: StandaloneFolder, scenario: Scenario, tmp: Path, config_json: str | None, drive: Drive):
    """Build the runner and run warm-up + run; returns (runner, runner module) for the oracle (inside the scope)."""
    from model_infer_kvcache.validators.checkout_run.compat import legacy_rope_scaling
    from model_infer_kvcache.validators.checkout_run.engine_run import HalfDtypesAs

    cls, config, notes = tiny_config(sf, config_json)
    drive.replaced += notes
    config.save_pretrained(str(tmp))
    drive.config = config.to_dict()
    module = importlib.import_module(sf.runner_module)
    runner_cls = getattr(module, sf.runner_class)
    drive.serving = serves_requests(runner_cls)
    settings = _settings(sf, scenario, tmp, drive)
    with legacy_rope_scaling(cls):
        with HalfDtypesAs(torch.float32):  # the runner's loader builds in bfloat16: the comparison runs float32
            runner = runner_cls(settings)
            runner.init_model()
        runner.model.float()
        _reinit(runner.model, scenario.seed)
        drive.driven += [f"{sf.runner_class}.__init__(settings) and .init_model() ({sf.runner_file.name}; the "
                         "folder's loader and config class)"]
        drive.replaced.append("weights: the folder's DummyModelLoader values replaced by seeded N(0, 1/fan_in) in "
                              "float32 (its uniform +-1e-3 bfloat16 values make every logit near-uniform)")
        def where(fn: str) -> str:
            """``Class.fn (file:line)`` at the ``def`` line (getsourcelines starts at a decorator)."""
            code = inspect.unwrap(getattr(runner_cls, fn))
            lines, start = inspect.getsourcelines(code)
            offset = next((i for i, t in enumerate(lines) if t.lstrip().startswith(f"def {fn}(")), 0)
            return f"{sf.runner_class}.{fn} ({Path(inspect.getsourcefile(code)).name}:{start + offset})"

        drive.prompts = prompts_of(scenario, int(getattr(runner.model.config, "vocab_size", 512)), drive.serving)
        if drive.serving:
            drive.kv_len_source = drive.cache_source = where("model_generate")
            drive.budgets, drive.rows = list(scenario.stream_budgets), scenario.stream_rows
            pending = _spy_metadata(sf, runner, drive)
        else:
            drive.kv_len_source, drive.cache_source = where("model_output_process"), where("model_input_prepare")
        real = runner.model_inference
        current = drive.warm_steps  # the steps land where they belong as they run: a failure keeps the ones before it

        def caches(model_inputs):
            if drive.serving:
                return [t for _, t in module_caches(runner.model)]
            return _cache_tensors(model_inputs.get("past_key_values"))

        def spy(model_inputs, is_prefill=False, warm_up=False):
            before = [t.clone() for t in caches(model_inputs)] if not drive.serving else []
            drive.step_writes = []
            out = real(model_inputs, is_prefill=is_prefill, warm_up=warm_up)
            logits = out[0] if isinstance(out, tuple) else out
            ptrs = tuple(t.untyped_storage().data_ptr() for t in caches(model_inputs))
            step = Step(bool(is_prefill), logits.detach().reshape(logits.shape[0], -1, logits.shape[-1])[:, -1].double(),
                        cache_ptrs=ptrs)
            if drive.serving:
                step.rows, step.prompt_lens = pending.get("rows"), pending.get("prompt_lens")
                step.site = pending.get("site", "?")
                step.ids = model_inputs["input_ids"].reshape(-1).tolist() if "input_ids" in model_inputs else []
                step.positions = model_inputs["position_ids"].reshape(-1).tolist() \
                    if "position_ids" in model_inputs else []
                step.slots = [w["slots"] for w in drive.step_writes if w["slots"] is not None]
                pending.clear()
                if not drive.caches:
                    drive.input_keys = _input_keys(model_inputs)
                    drive.caches = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                    for name, t in module_caches(runner.model)]
            elif not is_prefill:
                step.written = _targeted(drive.step_writes) or \
                    _written_positions(before, _cache_tensors(model_inputs.get("past_key_values")))
            elif not drive.caches:
                drive.caches = [(f"past_key_values[{i}]", tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                for i, t in enumerate(_cache_tensors(model_inputs.get("past_key_values")))]
            current.append(step)
            return out

        runner.model_inference = spy
        extra = {"max_new_tokens": list(drive.budgets)} if drive.serving else {}
        runner.model_generate([list(p) for p in drive.prompts], warm_up=True, **extra)
        current = drive.steps
        runner.model_generate([list(p) for p in drive.prompts], **extra)
        if drive.serving:
            drive.block_table = runner.block_table.clone()
            drive.block_size = int(drive.caches[0][1][1]) if drive.caches else 0
            drive.driven.append(f"{sf.runner_class}.model_generate(prompts, warm_up=True, max_new_tokens=budgets), "
                                "then the same call on the same runner (its own admission, row bookkeeping, "
                                "_build_forward_metadata, model_inference and _advance_kv_len)")
        else:
            drive.driven.append(f"{sf.runner_class}.model_generate(prompts, warm_up=True), then "
                                "model_generate(prompts) on the same runner (its model_input_prepare, "
                                "model_inference, model_output_process)")
        return runner, module
