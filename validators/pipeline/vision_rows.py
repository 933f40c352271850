"""Mllama's image per request, as its processor hands it to the model (transformers processing_mllama.py and
modeling_mllama.py): a request carries one image or none, its image token sits at some row of the prompt, and the
vision states it brings are the padded reservation (every tile, the padding tiles' rows too) of which the image's
own tiles are a prefix. What follows for the text rows comes from transformers, read here once:

- a row before the image token has an all-zero cross_attention_mask row (get_cross_attention_token_mask: the image
  is seen from its token on); _prepare_cross_attention_mask turns such a row into no mask at all (the row attends
  over every vision position, padding included) and a 0 in full_text_row_masked_out_mask, which zeroes the row's
  MLP output in MllamaCrossAttentionDecoderLayer;
- a request without an image runs with no cross_attention_states, and MllamaTextModel skips its cross-attention
  blocks (nothing cached): the blocks are the identity for it.

The validation's requests: which have an image and where its token sits is drawn per request (seeded by its first
prompt tokens, as its encoder states are); the reference gets transformers' own mask built from that."""

from __future__ import annotations

import inspect
import sys
import zlib

import torch

NO_IMAGE_ONE_IN = 3  # about one request in three comes without an image (a text-only chat turn)
KEY_TOKENS = 8  # every stream prompt is at least this long: the image token sits in the first KEY_TOKENS rows


def image_row(seed: int, token_ids) -> int | None:
    """The prompt row of the request's image token (0..KEY_TOKENS-1), None: a request without an image."""
    key = tuple(int(t) for t in list(token_ids)[:KEY_TOKENS])
    draw = zlib.crc32(repr(("image", seed, key)).encode())
    return None if draw % NO_IMAGE_ONE_IN == 0 else (draw // NO_IMAGE_ONE_IN) % KEY_TOKENS


def padded(states: torch.Tensor, max_len: int) -> torch.Tensor:
    """[max_len, hidden]: the image's valid states then the padding tiles' rows (random, fixed by the valid length),
    what MllamaModel.forward hands the text model: every tile of the reservation, padding included."""
    pad = torch.randn(max_len - len(states), states.shape[-1], dtype=states.dtype,
                      generator=torch.Generator().manual_seed(len(states)))
    return torch.cat([states, pad])


def reference_kwargs(ref_model, states: torch.Tensor | None, start: int | None, max_len: int,
                     length: int) -> dict | None:
    """The reference's vision inputs for a request of ``length`` tokens (None: the model takes no cross_attention_mask,
    not Mllama): no image: no cross_attention_states (MllamaTextModel skips the cross blocks); else the padded states
    and transformers' own mask of an image token at row ``start`` whose image covers ``len(states)`` vision positions
    (one mask column per position: get_cross_attention_token_mask, convert_sparse_cross_attention_mask_to_dense and
    _prepare_cross_attention_mask, as MllamaModel.forward calls it)."""
    module = sys.modules.get(type(ref_model).__module__)
    prepare = getattr(module, "_prepare_cross_attention_mask", None)
    if "cross_attention_mask" not in inspect.signature(ref_model.forward).parameters or prepare is None:
        return None
    if start is None:
        return {"cross_attention_states": None}
    from transformers.models.mllama import processing_mllama as proc

    image_token = -1  # any id no prompt row holds: the mask follows the row, not the id
    ids = [0] * length
    ids[start] = image_token
    dense = proc.convert_sparse_cross_attention_mask_to_dense(
        [proc.get_cross_attention_token_mask(ids, image_token)], [[len(states)]], max_len, length)
    mask, rows = prepare(torch.from_numpy(dense), num_vision_tokens=1, dtype=ref_model.dtype)
    return {"cross_attention_states": padded(states, max_len)[None].to(ref_model.dtype),
            "cross_attention_mask": mask, "full_text_row_masked_out_mask": rows}
