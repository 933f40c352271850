"""validate_cache_info errors (naming layer and entry) and allocate_cache_tensors."""

import pytest
import torch
from model_infer_kvcache.validators.harness import (
    CacheInfoError,
    KVCacheManager,
    allocate_cache_tensors,
    calculate_block_num,
    get_generation,
    validate_cache_info,
)

G1 = get_generation("G1")
G2 = get_generation("G3")  # the G2 contract with the HEAD-era fields (compress_ratio, cache_layout)


def _g2_entry(name="k_cache", attn="FullAttention", **kw):
    base = dict(cache_name=name, attn_type=attn, dim=8, num_head=2, dtype=torch.bfloat16, needs_block=True,
                block_size=4, tensor_setter=lambda t: None)
    base.update(kw)
    return G2.CacheEntry(**base)


def _g2_info(*layers):
    return G2.ModelCacheInfo(len(layers), [G2.LayerCacheInfo(i, list(c)) for i, c in enumerate(layers)])


def _ok_layer():
    return [_g2_entry("k_cache"), _g2_entry("v_cache")]


@pytest.mark.parametrize(
    "bad_layer, message",
    [
        ([_g2_entry("k_cache"), _g2_entry("v_cache", block_size=8)], "block_size 8 differs"),
        ([_g2_entry("k_cache", "SlidingWindow")], "needs a positive sliding_window"),
        ([_g2_entry("k_cache", "ChunkedLocal")], "unsupported attn_type 'ChunkedLocal'"),
        ([_g2_entry("k_cache", num_head=0)], "num_head must be a positive int"),
        ([_g2_entry("k_cache", dim=0)], "dim must be positive"),
        ([_g2_entry("k_cache", dim=[64, 0])], "dim must be positive"),
        ([_g2_entry("k_cache", block_size=None)], "block_size must be a positive int"),
        ([_g2_entry("k_cache", dtype="bfloat16")], "dtype must be a torch.dtype"),
        ([_g2_entry("k_cache", block_size=6, compress_ratio=4)], "not divisible by compress_ratio"),
    ],
)
def test_invalid_entries_name_layer_and_entry(bad_layer, message):
    info = _g2_info(_ok_layer(), bad_layer)
    with pytest.raises(CacheInfoError, match=message) as err:
        validate_cache_info(info)
    text = str(err.value)
    assert "layer 1" in text
    bad_name = "v_cache" if bad_layer[0].cache_name == "k_cache" and len(bad_layer) == 2 else "k_cache"
    assert f"entry '{bad_name}'" in text


def test_mismatched_block_size_across_layers_of_one_group():
    # Same group (FullAttention) declared with block 4 in layer 0 and block 8 in layer 2.
    info = _g2_info(_ok_layer(), _ok_layer(), [_g2_entry("k_cache", block_size=8), _g2_entry("v_cache", block_size=8)])
    with pytest.raises(CacheInfoError, match=r"layer 2, entry 'k_cache'.*block_size 8 differs from 4 \(layer 0"):
        validate_cache_info(info)
    # A distinct manager_key makes it a separate group, which is fine.
    info = _g2_info(_ok_layer(), [_g2_entry("k_cache", block_size=8, manager_key="big"),
                                  _g2_entry("v_cache", block_size=8, manager_key="big")])
    validate_cache_info(info)


def test_group_mixing_attn_types_or_windows():
    mixed = _g2_info([_g2_entry("k_cache", manager_key="g"),
                      _g2_entry("v_cache", "SlidingWindow", manager_key="g", sliding_window=4)])
    with pytest.raises(CacheInfoError, match="mixes attn_type"):
        validate_cache_info(mixed)
    windows = _g2_info([_g2_entry("k_cache", "SlidingWindow", sliding_window=4)],
                       [_g2_entry("k_cache", "SlidingWindow", sliding_window=8)])
    with pytest.raises(CacheInfoError, match="layer 1, entry 'k_cache': sliding_window 8 differs"):
        validate_cache_info(windows)


def test_model_level_checks():
    with pytest.raises(CacheInfoError, match="num_layers mismatch"):
        validate_cache_info(G2.ModelCacheInfo(3, [G2.LayerCacheInfo(0, _ok_layer())]))
    with pytest.raises(CacheInfoError, match="layer 0 must define at least one cache entry"):
        validate_cache_info(_g2_info([]))
    g1_entry = G1.CacheEntry("k_cache", "FullAttention", 8, 2, torch.float16, True, lambda t: None)
    with pytest.raises(CacheInfoError, match="ModelCacheInfo.block_size"):
        validate_cache_info(G1.ModelCacheInfo(1, 0, [G1.LayerCacheInfo(0, [g1_entry])]))
    validate_cache_info(G1.ModelCacheInfo(1, 128, [G1.LayerCacheInfo(0, [g1_entry])]))


def test_entries_without_blocks_are_not_checked():
    scratch = _g2_entry("scratch", "Whatever", num_head=0, block_size=None, needs_block=False)
    validate_cache_info(_g2_info([*_ok_layer(), scratch]))


class _Layer:
    pass


def test_allocate_cache_tensors_calls_setters_with_block_shapes():
    layer0, layer1 = _Layer(), _Layer()
    info = _g2_info(
        [_g2_entry("k_cache", tensor_setter=lambda t: setattr(layer0, "k", t)),
         _g2_entry("v_cache", tensor_setter=lambda t: setattr(layer0, "v", t))],
        [_g2_entry("nope_cache", dim=16, num_head=1, block_size=8, manager_key="latent",
                   tensor_setter=lambda t: setattr(layer1, "nope", t)),
         _g2_entry("skip", needs_block=False, tensor_setter=lambda t: setattr(layer1, "skip", t))],
    )
    blocks = calculate_block_num(info, max_concurrency=2, offline_max_len=20)
    # FullAttention: ceil(20/4) * 2 + 1 = 11; latent: ceil(20/8) * 2 + 1 = 7.
    assert blocks == {"FullAttention": 11, "latent": 7}
    by_key = allocate_cache_tensors("cpu", info, blocks, fill_value=0.0)
    assert layer0.k.shape == (11, 4, 2, 8) and layer0.k.dtype == torch.bfloat16
    assert layer0.v.shape == (11, 4, 2, 8) and layer0.v.data_ptr() != layer0.k.data_ptr()
    assert layer1.nope.shape == (7, 8, 1, 16)
    assert not hasattr(layer1, "skip")
    assert info.layer_infos[0].caches[0].tensor is layer0.k  # G2 records the tensor on the entry
    assert [t.shape for t in by_key["latent"]] == [(7, 8, 1, 16)]
    assert len(by_key["FullAttention"]) == 2


def test_allocate_cache_tensors_g1_model_block_size_and_missing_setter():
    layer = _Layer()
    entry = G1.CacheEntry("k_cache", "FullAttention", 8, 2, torch.float16, True,
                          lambda t: setattr(layer, "k", t))
    info = G1.ModelCacheInfo(1, 16, [G1.LayerCacheInfo(0, [entry])])
    allocate_cache_tensors("cpu", info, {"FullAttention": 5})
    assert layer.k.shape == (5, 16, 2, 8) and entry.tensor is layer.k
    entry.tensor_setter = None
    with pytest.raises(CacheInfoError, match="layer 0, entry 'k_cache': CacheEntry has no tensor_setter"):
        allocate_cache_tensors("cpu", info, {"FullAttention": 5})
    with pytest.raises(KeyError, match="FullAttention"):
        entry.tensor_setter = lambda t: None
        allocate_cache_tensors("cpu", info, {"Other": 5})


def test_manager_factory_rejects_unknown_group():
    info = _g2_info(_ok_layer())
    with pytest.raises(CacheInfoError, match="layer 0, entry 'k_cache'"):
        KVCacheManager.from_cache_info(info, {"Other": 4}, max_model_len=16)


def test_g3_cache_layout_shapes_and_unknown_layouts_refused():
    # "BnNBsD" puts heads before rows, as allocate_cache_tensors does at HEAD; other layouts are refused.
    layer = _Layer()
    info = _g2_info([_g2_entry("k_cache", cache_layout="BnNBsD", tensor_setter=lambda t: setattr(layer, "k", t)),
                     _g2_entry("v_cache", compress_ratio=2, tensor_setter=lambda t: setattr(layer, "v", t))])
    validate_cache_info(info)
    allocate_cache_tensors("cpu", info, {"FullAttention": 3})
    assert layer.k.shape == (3, 2, 4, 8)  # [blocks, heads, block_size, dim]
    assert layer.v.shape == (3, 2, 2, 8)  # [blocks, block_size / compress_ratio, heads, dim]
    with pytest.raises(CacheInfoError, match="unsupported cache_layout 'BSND'"):
        validate_cache_info(_g2_info([_g2_entry("k_cache", cache_layout="BSND")]))


def test_g3_mamba_entries_need_the_g3_manager_map():
    from model_infer_kvcache.validators.harness.managers import ATTN_TYPE_MANAGER_MAP_G3

    state = G2.MambaCacheEntry(cache_name="ssm", dtype=torch.float32, needs_block=True, shape=[2, 3],
                               tensor_setter=lambda t: None)
    info = _g2_info([state, _g2_entry("k_cache")])
    validate_cache_info(info, manager_map=ATTN_TYPE_MANAGER_MAP_G3)
    with pytest.raises(CacheInfoError, match="unsupported attn_type 'Mamba'"):
        validate_cache_info(info)  # G0-G2 have no Mamba manager
    blocks = calculate_block_num(info, max_concurrency=2, offline_max_len=8)
    assert blocks == {"Mamba": 3, "FullAttention": 5}  # 2 x (1 + next_n) + 1; ceil(8/4) x 2 + 1
