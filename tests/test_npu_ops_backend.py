"""Backend selection (guarded torch_npu import) and install_emulation()."""

from __future__ import annotations

import importlib
import sys
import textwrap

import model_infer_kvcache.validators.npu_ops as npu_ops
import pytest
import torch
from model_infer_kvcache.validators.npu_ops import backend, emulated, install_emulation, load

MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    """Install a stand-in ``torch_npu`` package on sys.path; yields a writer for its __init__."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = sys.modules.pop("torch_npu", None)

    def write(source: str) -> None:
        (pkg / "__init__.py").write_text(textwrap.dedent(source))
        sys.modules.pop("torch_npu", None)
        importlib.invalidate_caches()

    yield write
    sys.modules.pop("torch_npu", None)
    if saved is not None:
        sys.modules["torch_npu"] = saved


def test_emulated_backend_and_auto_on_cpu():
    ops = load("emulated")
    assert ops.backend == "emulated"
    assert ops.npu_fused_infer_attention_score is emulated.npu_fused_infer_attention_score
    with pytest.raises(AttributeError):
        ops.npu_not_an_op  # noqa: B018
    with pytest.raises(ValueError):
        load("gpu")


@pytest.mark.parametrize("failure", ["raise OSError('libascendcl.so: cannot open shared object file')",
                                     "raise SystemExit(3)", "raise RuntimeError('CANN not found')"])
def test_broken_torch_npu_import_falls_back(fake_torch_npu, failure):
    fake_torch_npu(failure)
    ok, reason = backend.npu_available()
    assert not ok and "import torch_npu failed" in reason
    assert load().backend == "emulated"
    with pytest.raises(RuntimeError, match="no NPU backend is usable"):
        load("npu")


def test_torch_npu_without_device(fake_torch_npu):
    fake_torch_npu("""
        class npu:
            @staticmethod
            def is_available():
                return False
            @staticmethod
            def device_count():
                return 0
    """)
    assert load().backend == "emulated"
    with pytest.raises(RuntimeError, match="no NPU is visible"):
        load("npu")


def test_torch_npu_with_device_is_used(fake_torch_npu):
    fake_torch_npu("""
        class npu:
            @staticmethod
            def is_available():
                return True
            @staticmethod
            def device_count():
                return 1
        def npu_fused_infer_attention_score(*args, **kwargs):
            return "real"
    """)
    ops = load()
    assert ops.backend == "npu" and ops.npu_fused_infer_attention_score() == "real"
    assert load("npu").backend == "npu"
    # install_emulation must not shadow a real torch_npu that is already imported
    with pytest.raises(RuntimeError, match="real torch_npu"):
        with install_emulation():
            pass
    assert sys.modules["torch_npu"].npu_fused_infer_attention_score() == "real"


def test_install_emulation_exposes_module_and_torch_ops():
    saved = sys.modules.pop("torch_npu", None)
    try:
        q = torch.randn(3, 4, 16)
        kw = dict(atten_mask=MASK, actual_seq_lengths=[3], actual_seq_lengths_kv=[3], num_heads=4, scale=0.25,
                  input_layout="TND", sparse_mode=3)
        expected, _ = emulated.npu_fused_infer_attention_score(q, q, q, **kw)
        with install_emulation() as module:
            assert npu_ops.emulation_installed()
            import torch_npu

            assert torch_npu is module
            assert torch_npu.npu_fused_infer_attention_score.__wrapped__ is emulated.npu_fused_infer_attention_score
            out, lse = torch.ops.npu.npu_fused_infer_attention_score(q, q, q, **kw)
            assert torch.equal(out, expected) and lse.numel() == 0
            cache = torch.zeros(4, 2)
            torch.ops.npu.npu_scatter_nd_update_(cache, torch.tensor([[2]]), torch.ones(1, 2))
            assert cache[2].tolist() == [1.0, 1.0]
            outs = torch.ops.npu.npu_kv_rmsnorm_rope_cache(
                torch.randn(1, 1, 1, 48), torch.ones(32), torch.ones(1, 1, 1, 16), torch.zeros(1, 1, 1, 16),
                torch.tensor([0]), torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 32), cache_mode="PA",
                is_output_kv=True)
            assert len(outs) == 4
            with pytest.raises(RuntimeError, match="Unknown keyword"):
                torch.ops.npu.npu_fused_infer_attention_score_v2(q, q, q, scale=0.1)
            with pytest.raises(RuntimeError, match="already active"):
                with install_emulation():
                    pass
        assert not npu_ops.emulation_installed()
        assert "torch_npu" not in sys.modules
        assert not hasattr(torch.ops.npu, "npu_fused_infer_attention_score")
        with pytest.raises(ImportError):
            importlib.import_module("torch_npu")
    finally:
        sys.modules.pop("torch_npu", None)
        if saved is not None:
            sys.modules["torch_npu"] = saved


def test_install_emulation_is_undone_after_an_error():
    with pytest.raises(ZeroDivisionError):
        with install_emulation():
            1 / 0  # noqa: B018
    assert "torch_npu" not in sys.modules and not hasattr(torch.ops.npu, "scatter_update_")
    with install_emulation():  # can be installed again
        assert hasattr(torch.ops.npu, "scatter_update_")
    assert not hasattr(torch.ops.npu, "scatter_update_")


def test_leftover_kernel_refuses_outside_the_context():
    kernel = backend._dispatching_kernel("npu_scatter_nd_update")
    with pytest.raises(RuntimeError, match="only active inside"):
        kernel(torch.zeros(2), torch.tensor([[0]]), torch.ones(1))
