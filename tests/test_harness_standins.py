"""CPU stand-ins for the device stack, and the harness scheduler driving a real checkout through them."""

from __future__ import annotations

import sys

import pytest
import torch
from model_infer_kvcache.validators.harness import FrameworkAPI, Scheduler, install_framework
from model_infer_kvcache.validators.npu_ops import install_emulation
from model_infer_kvcache.validators.standins import NotStoodInError, device_standins, standins_active
from model_infer_kvcache.validators.standins.third_party import absent_third_party
from shared_dirs import upstream_head, upstream_history

NAMES = ("torch_npu", "torchair", "torch.npu", "torchair.ops", "torch_npu.npu")


def _snapshot():
    return ({n: sys.modules.get(n) for n in NAMES}, "npu" in torch.__dict__, "npu" in torch.Tensor.__dict__)


def test_installed_inside_and_restored_after():
    before = _snapshot()
    with device_standins(free_bytes=3 * 2**30, total_bytes=8 * 2**30) as handle:
        import torch_npu
        import torchair

        assert standins_active()
        assert torch.npu.mem_get_info() == (3 * 2**30, 8 * 2**30)
        handle.set_mem_info(5, 10)
        assert torch_npu.npu.mem_get_info() == (5, 10)
        x = torch.ones(2)
        assert x.npu() is x
        with torch.npu.stream(torch.npu.Stream()):
            torch.npu.Event().record()
        with torchair.scope.npu_stream_switch("1", 3):
            pass
        assert torchair.scope.npu_wait_tensor(x, x) is x
        # The emulated operators are reachable both ways.
        assert callable(torch_npu.npu_fused_infer_attention_score)
        assert hasattr(torch.ops.npu, "npu_fused_infer_attention_score")
    assert _snapshot() == before and not standins_active()


def test_missing_attribute_names_itself_and_the_caller():
    with device_standins():
        import torch_npu

        with pytest.raises(NotStoodInError, match=r"torch_npu\.npu_no_such_op .*test_harness_standins\.py:\d+"):
            _ = torch_npu.npu_no_such_op
        with pytest.raises(NotStoodInError, match=r"torch\.npu\.no_such_call"):
            torch.npu.no_such_call()


def test_extends_an_active_emulation_and_leaves_it_as_it_was():
    with install_emulation() as fake:
        with device_standins() as handle:
            assert handle.torch_npu is fake and fake.npu is torch.npu
        assert "npu" not in fake.__dict__ and sys.modules["torch_npu"] is fake
        assert "npu" not in torch.__dict__


def test_the_npu_device_is_the_cpu_for_tensors_too():
    # Upstream qwen3_5 builds its decode buffers with device=torch.npu.current_device(): an int, which CPU torch
    # reads as CUDA ("Cannot access accelerator device when none is available") without the stand-in.
    with device_standins():
        made = [torch.zeros(2, device=torch.npu.current_device()), torch.arange(3, device="npu"),
                torch.empty(1, dtype=torch.int32, device="npu:0"), torch.ones(1).to("npu:0"),
                torch.ones(1).to(0, torch.float64), torch.zeros(1, device="cpu")]
        assert all(t.device.type == "cpu" for t in made)
        assert made[4].dtype == torch.float64  # the rest of the call is kept
    with pytest.raises((RuntimeError, AssertionError)):  # off again on exit
        torch.zeros(1, device=0)


def test_index_copy_takes_the_int32_index_the_npu_takes():
    # torch_npu's index_copy_ goes to aclnnInplaceIndexCopy (INT32 or INT64 index); CPU torch wants int64. Upstream
    # bailing_2_5 writes its lightning states back with int32 block ids.
    index = torch.tensor([2, 0], dtype=torch.int32)
    source = torch.arange(6.0).view(2, 3)
    with device_standins():
        got = torch.zeros(3, 3).index_copy_(0, index, source)
        out = torch.index_copy(torch.zeros(3, 3), 0, index, source)
        kw = torch.zeros(3, 3).index_copy(0, index=index, source=source)
    want = torch.zeros(3, 3).index_copy_(0, index.long(), source)
    assert torch.equal(got, want) and torch.equal(out, want) and torch.equal(kw, want)
    with pytest.raises(RuntimeError, match="long"):  # off again on exit
        torch.zeros(3, 3).index_copy_(0, index, source)


def test_does_not_nest():
    with device_standins(), pytest.raises(RuntimeError, match="nest"), device_standins():
        pass


def _one_layer_scheduler(fw, generation: str) -> Scheduler:
    """A harness scheduler over one full-attention layer declared with the checkout's own cache_info types."""
    module = fw.cache_info
    entries = []
    for name in ("k_cache", "v_cache"):
        kwargs = {"cache_name": name, "attn_type": "FullAttention", "dim": 8, "num_head": 2,
                  "dtype": torch.float32, "needs_block": True, "tensor_setter": lambda t: None}
        if generation in ("G2", "G3"):
            kwargs["block_size"] = 4
        entries.append(module.CacheEntry(**kwargs))
    layers = [module.LayerCacheInfo(0, entries)]
    info = (module.ModelCacheInfo(1, layers) if generation in ("G2", "G3")
            else module.ModelCacheInfo(1, 4, layers))
    return Scheduler(info, max_model_len=24, max_concurrency=3, api=FrameworkAPI.from_handle(fw))


@pytest.mark.parametrize("commit, generation", [
    ("f0b0fde", "G0"), ("2c2336a", "G1"), ("48a59dc", "G2"), ("HEAD", "G3"),
])
def test_scheduler_drives_each_real_checkout(commit, generation):
    root = upstream_head() if commit == "HEAD" else upstream_history(commit)
    # The third-party stand-ins too (what `validate --framework-root` installs): G2+ allocation imports the
    # serving stack, whose packages this machine may or may not have; under them every step is the checkout's.
    with device_standins(), absent_third_party(), install_framework(framework_root=root) as fw:
        assert fw.generation == generation and fw.real
        sched = _one_layer_scheduler(fw, generation)
        assert sched.provenance == {
            "validate_cache_info": "checkout", "calculate_block_num": "checkout", "KVCacheManager": "checkout",
            "create_single_type_managers": "checkout", "prepare_block_tables": "checkout",
            "prepare_slot_mapping": "checkout", "allocate_cache_tensors": "checkout"}
        assert type(sched.kv_cache_manager).__module__.startswith("executor.core.kv_cache")
        for prompt, new in (([1, 2, 3, 4, 5], 2), ([6, 7], 4), ([8, 9, 10], 6)):
            sched.add_request(prompt, max_new_tokens=new)
        padded = []
        while sched.has_work():
            step = sched.next_step()
            if not step.is_prefill:
                padded.append(step.padded_rows)
                rows = step.forward_metadata.block_table["FullAttention"][len(step.request_ids):]
                assert (rows == 0).all()  # padded rows point at the null block only
            sched.complete_step(step, [0] * len(step.request_ids))
        # G1 on pads every decode batch to max_concurrency; G0 could not.
        assert padded and (all(p == 0 for p in padded) if generation == "G0" else max(padded) == 2)
        assert all(u["used"] == 0 for u in sched.usage().values())


def test_absent_third_party_stands_in_only_for_what_is_missing_and_leaves_no_trace(monkeypatch):
    """Checkout-only imports of modules that are not installed: importable, subclassable, refusing when called;
    an installed module is never replaced; everything registered is gone afterwards."""
    import importlib.util

    from model_infer_kvcache.validators.standins import third_party

    monkeypatch.setattr(third_party, "OPTIONAL_THIRD_PARTY", {"kvcache_no_such_pkg": "a test feature",
                                                               "json": "installed: never replaced"})
    monkeypatch.setattr(third_party, "OPTIONAL_SUBMODULES", {"kvcache_no_such_pkg": ("sub",)})
    assert importlib.util.find_spec("kvcache_no_such_pkg") is None
    real_json = sys.modules.get("json")
    with third_party.absent_third_party() as described:
        import json

        import kvcache_no_such_pkg
        from kvcache_no_such_pkg.sub import Thing

        assert json is real_json
        assert described[0] == ("kvcache_no_such_pkg: not installed; a module whose attributes raise when "
                                "called (a test feature)")
        assert not any(d.startswith("json") for d in described)

        class Local(Thing):  # module-level subclassing in the checkout must import
            pass

        assert Local.__mro__[1] is object
        with pytest.raises(RuntimeError, match=r"kvcache_no_such_pkg\.load_dataset is not available .*a test feature"):
            kvcache_no_such_pkg.load_dataset("x")
    assert "kvcache_no_such_pkg" not in sys.modules and "kvcache_no_such_pkg.sub" not in sys.modules
    assert sys.modules.get("json") is real_json


@pytest.mark.parametrize("commit", ["48a59dc", "HEAD"])
def test_allocation_falls_back_to_the_harness_when_the_serving_stack_does_not_import(commit, monkeypatch):
    """G2+ allocate_cache_tensors imports the KV-transfer package, which imports requests. Where that import
    fails (blocked here, so the test means the same on machines with and without requests), the harness
    allocates the same shapes and the provenance names what was missing."""
    monkeypatch.setitem(sys.modules, "requests", None)
    root = upstream_head() if commit == "HEAD" else upstream_history(commit)
    with device_standins(), install_framework(framework_root=root) as fw:
        sched = _one_layer_scheduler(fw, fw.generation)
        assert sched.provenance["allocate_cache_tensors"] == "harness (checkout's needs requests)"
        assert sched.provenance["KVCacheManager"] == "checkout"


def test_torchair_attention_is_graph_only_and_takes_tensor_lengths():
    """torchair.ops' fused attention (ge_graph decode): eagerly it refuses, as torchair's own kernels do; compiled it
    is torch.ops.air's operator, torch_npu's schema with the FA lengths as tensors, and replays the emulation."""
    from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS
    from model_infer_kvcache.validators.npu_ops.backend import air_schema

    v2 = FA_KEYWORDS["v2"]
    schema = air_schema(v2.op)
    assert f"Tensor? {v2.q_lens}=None" in schema and f"Tensor? {v2.kv_lens}=None" in schema
    assert "SymInt[]? actual_seq" not in schema
    with device_standins():
        import torchair

        q = torch.randn(2, 2, 8, dtype=torch.float64)  # TND: two requests of one token
        cache = torch.randn(2, 16, 2 * 8, dtype=torch.float64)  # [blocks, block_size, N_kv * D]
        kwargs = dict(num_query_heads=2, num_key_value_heads=2, input_layout="TND", softmax_scale=0.35,
                      sparse_mode=0, block_table=torch.tensor([[0], [1]], dtype=torch.int32), block_size=16)
        lens = {v2.q_lens: torch.tensor([1, 2]), v2.kv_lens: torch.tensor([3, 2])}
        with pytest.raises(NotImplementedError, match="does not support eager mode"):
            getattr(torchair.ops, v2.op)(q, cache, cache, **kwargs, **lens)
        import torch_npu

        eager = getattr(torch_npu, v2.op)(q, cache, cache, **kwargs, **{k: v.tolist() for k, v in lens.items()})[0]
        torch._dynamo.reset()
        compiled = torch.compile(lambda *a, **k: getattr(torchair.ops, v2.op)(*a, **k)[0], fullgraph=True,
                                 dynamic=False, backend="eager")
        assert torch.equal(compiled(q, cache, cache, **kwargs, **lens), eager)
        torch._dynamo.reset()
