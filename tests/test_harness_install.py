"""install_framework: harness modules per generation, real-checkout mode, and clean restoration."""

import sys
import textwrap
import types

import pytest
import torch
from model_infer_kvcache.validators.harness import (
    FrameworkAPI,
    FrameworkImportError,
    Scheduler,
    get_generation,
    install_framework,
)


def _executor_modules():
    return {n for n in sys.modules if n == "executor" or n.startswith("executor.")}


@pytest.mark.parametrize("gen", ["G0", "G1", "G2"])
def test_harness_modules_resolve_per_generation(gen):
    path_before = list(sys.path)
    with install_framework(gen) as handle:
        from executor.core.kv_cache import KVCacheManager, ModelCacheInfo, create_single_type_managers
        from executor.core.kv_cache.cache_info import CacheEntry, LayerCacheInfo
        from executor.core.kv_cache.cache_utils import calculate_block_num, validate_cache_info
        from executor.utils.common_utils import get_init_attn_mask
        from executor.utils.forward_metadata import ForwardMetaData, get_forward_metadata

        expected = get_generation(gen)
        assert CacheEntry is expected.CacheEntry and ModelCacheInfo is expected.ModelCacheInfo
        assert LayerCacheInfo is expected.LayerCacheInfo
        assert handle.generation == gen and not handle.real
        assert isinstance(get_forward_metadata(), ForwardMetaData)
        mask = get_init_attn_mask(2048, "cpu")
        assert mask.shape == (2048, 2048) and mask[0, 1] and not mask[1, 0]
        assert callable(calculate_block_num) and callable(validate_cache_info)
        assert callable(create_single_type_managers) and KVCacheManager.__name__ == "KVCacheManager"
    assert not _executor_modules()
    assert sys.path == path_before


def test_previous_executor_modules_are_restored():
    sentinel = types.ModuleType("executor")
    sys.modules["executor"] = sentinel
    try:
        with install_framework("G2"):
            import executor

            assert executor is not sentinel
        assert sys.modules["executor"] is sentinel
    finally:
        del sys.modules["executor"]


def test_restores_on_error():
    with pytest.raises(RuntimeError, match="boom"), install_framework("G1"):
        raise RuntimeError("boom")
    assert not _executor_modules()


def test_model_style_code_runs_inside_install():
    # What rendered framework code looks like: cache entries built from the installed classes.
    source = textwrap.dedent(
        """
        import torch
        from executor.core.kv_cache.cache_info import CacheEntry, LayerCacheInfo, ModelCacheInfo

        class Attn:
            def __init__(self, idx):
                self.k_cache = torch.Tensor([])
                self.cache_entries = [CacheEntry(
                    cache_name="k_cache", attn_type="FullAttention", dim=4, num_head=1,
                    dtype=torch.float32, needs_block=True,
                    tensor_setter=lambda t, layer=self: setattr(layer, "k_cache", t))]

        layers = [Attn(0), Attn(1)]

        def get_cache_info():
            infos = [LayerCacheInfo(layer_idx=i, caches=list(l.cache_entries)) for i, l in enumerate(layers)]
            return ModelCacheInfo(num_layers=len(infos), block_size=8, layer_infos=infos, is_mla_backend=False)
        """
    )
    with install_framework("G1"):
        namespace = {}
        exec(compile(source, "<rendered>", "exec"), namespace)
        info = namespace["get_cache_info"]()
        sched = Scheduler(info, max_model_len=32, max_concurrency=2, generation="G1")
        assert namespace["layers"][1].k_cache.shape == (9, 8, 1, 4)  # ceil(32/8)*2+1 blocks
        assert sched.api.generation == "G1"
    with install_framework("G2"):
        namespace = {}
        exec(compile(source, "<rendered>", "exec"), namespace)
        # G2 ModelCacheInfo has no block_size: G1-style code fails when it builds the info.
        with pytest.raises(TypeError, match="block_size"):
            namespace["get_cache_info"]()


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def fake_checkout(tmp_path):
    """A checkout laid out like the repository; parent __init__ files need an NPU (they raise)."""
    root = tmp_path / "recipes"
    npu_only = "raise ImportError('this package needs torch_npu')\n"
    _write(root / "executor" / "__init__.py", npu_only)
    _write(root / "executor" / "core" / "__init__.py", npu_only)
    _write(root / "executor" / "utils" / "__init__.py", npu_only)
    _write(root / "executor" / "core" / "kv_cache" / "cache_info.py", """
        from dataclasses import dataclass
        from typing import Callable, List, Optional

        @dataclass
        class CacheEntry:
            cache_name: str
            attn_type: str
            dim: int
            num_head: int
            dtype: object
            needs_block: bool
            tensor_setter: Optional[Callable] = None
            sliding_window: Optional[int] = None
            tensor: object = None

        @dataclass
        class LayerCacheInfo:
            layer_idx: int
            caches: List[CacheEntry]

        @dataclass
        class ModelCacheInfo:
            num_layers: int
            block_size: int
            layer_infos: List[LayerCacheInfo]
            is_mla_backend: bool = False
        """)
    # The managers / utilities are borrowed from the harness so the checkout is runnable here.
    _write(root / "executor" / "core" / "kv_cache" / "__init__.py", """
        from .cache_info import CacheEntry, LayerCacheInfo, ModelCacheInfo
        from model_infer_kvcache.validators.harness.install import build_harness_modules as _build
        _h = _build("G1")["executor.core.kv_cache"]
        KVCacheManager = _h.KVCacheManager
        create_single_type_managers = _h.create_single_type_managers
        prepare_block_tables = _h.prepare_block_tables
        prepare_slot_mapping = _h.prepare_slot_mapping
        REAL_CHECKOUT = True
        """)
    _write(root / "executor" / "utils" / "forward_metadata.py", """
        from dataclasses import dataclass, replace
        from typing import Optional

        @dataclass
        class ForwardMetaData:
            is_prefill: bool = False
            attention_mask: object = None
            kv_len: object = None
            actual_seq_lengths_kv: object = None
            actual_seq_lengths_q: object = None
            actual_seq_lengths_cu_kv: object = None
            actual_seq_lengths_cu_q: object = None
            prompt_tokens: int = 0
            block_table: Optional[dict] = None
            slot_mapping: Optional[dict] = None

        _fm = ForwardMetaData()

        def get_forward_metadata():
            return _fm

        def set_forward_metadata(**kw):
            global _fm
            _fm = replace(_fm, **kw)
        """)
    _write(root / "executor" / "utils" / "common_utils.py", "import torch_npu_not_installed_here\n")
    return root


def test_real_checkout_missing_module_is_named(fake_checkout):
    with pytest.raises(FrameworkImportError, match=r"executor\.utils\.common_utils"):
        with install_framework(framework_root=fake_checkout):
            pass
    assert not _executor_modules()
    assert str(fake_checkout) not in sys.path


def test_real_checkout_with_fallback(fake_checkout):
    with install_framework(framework_root=fake_checkout,
                           fallback_to_harness=["executor.utils.common_utils"]) as handle:
        import executor.core.kv_cache as kv
        from executor.core.kv_cache.cache_info import CacheEntry, LayerCacheInfo, ModelCacheInfo
        from executor.utils.common_utils import get_init_attn_mask

        assert kv.REAL_CHECKOUT and handle.real and handle.generation == "G1"
        assert handle.fallbacks == ["executor.utils.common_utils"]
        assert CacheEntry is not get_generation("G1").CacheEntry
        assert get_init_attn_mask(2048, None).shape == (2048, 2048)
        layer = types.SimpleNamespace()
        entries = [CacheEntry("k_cache", "FullAttention", 4, 1, torch.float32, True,
                              lambda t: setattr(layer, "k", t))]
        info = ModelCacheInfo(1, 4, [LayerCacheInfo(0, entries)])
        sched = Scheduler(info, max_model_len=16, max_concurrency=1, api=FrameworkAPI.from_handle(handle))
        sched.add_request([1, 2, 3, 4, 5])
        step = sched.next_step()
        # The checkout's own ForwardMetaData class (fields it lacks are simply not set).
        assert type(step.forward_metadata).__module__ == "executor.utils.forward_metadata"
        assert step.forward_metadata.slot_mapping["FullAttention"].tolist() == [4, 5, 6, 7, 8]
    assert not _executor_modules()


def test_not_a_checkout(tmp_path):
    with pytest.raises(FrameworkImportError, match="not a cann-recipes-infer checkout"):
        with install_framework(framework_root=tmp_path):
            pass
