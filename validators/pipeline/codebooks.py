"""Codebook streams (MusicGen, MusicGen-Melody): a causal LM whose every position is an audio frame of
``num_codebooks`` codes, embedded by one table per codebook and summed (transformers MusicgenDecoder.forward:
``inputs_embeds = sum(embed_tokens[k](input[:, k]))``), with one LM head per codebook. transformers takes the ids as
``(batch x num_codebooks, seq)`` rows, each batch's codebooks together (``input_ids.reshape(-1, num_codebooks, seq)``),
and returns logits as ``(batch x num_codebooks, seq, vocab)``; its attention and KV cache see one row per frame
(``batch`` rows, not ``batch x num_codebooks``). The delay pattern and classifier-free guidance arrange which ids are
fed and the batch, not the cache.

The validation's request stream and checks speak one token per position. Here a frame is one stream token: its codes
are the token's base-V digits (V the tiny model's code vocabulary, V ** num_codebooks >= the stream's vocabulary,
codebook k the k-th digit), and the frame's logits are the joint log-probabilities of every code tuple (the sum over
codebooks of each head's log-softmax at that codebook's digit), whose argmax is each head's own greedy code: greedy
decoding of the frame. The host and the reference both run through ``bind_frames``, so what is compared is the
model's own forward over frames (each head's logits enter every joint entry)."""

from __future__ import annotations

import functools
import types

import torch

# transformers' name of the codebook count (MusicgenDecoderConfig / MusicgenMelodyDecoderConfig.num_codebooks)
FIELD = "num_codebooks"


def code_vocab(streams: int, stream_vocab: int) -> int:
    """The smallest code vocabulary V >= 2 whose code tuples (V ** streams) number every stream token."""
    v = 2
    while v ** streams < stream_vocab:
        v += 1
    return v


def names_codebooks(d: dict) -> bool:
    """The config names several codebooks (``num_codebooks`` >= 2)."""
    streams = d.get(FIELD)
    return isinstance(streams, int) and not isinstance(streams, bool) and streams >= 2


def tiny_codebook_fields(d: dict, stream_vocab: int) -> str | None:
    """The tiny config's code vocabulary, in place, for a config with several codebooks; the note saying so (None
    for a one-stream config)."""
    if not names_codebooks(d):
        return None
    streams = d[FIELD]
    d["vocab_size"] = code_vocab(streams, stream_vocab)
    return (f"{FIELD} {streams}: each position is a frame of {streams} codes of vocabulary {d['vocab_size']} (a stream "
            f"token's base-{d['vocab_size']} digits), fed as transformers' (batch x {streams}, seq) rows; logits are the "
            "frame's joint log-probabilities (validators/pipeline/codebooks.py)")


def streams_of(model) -> int | None:
    """How many token streams the model embeds per position: its input embeddings as a list of tables (MusicGen's
    ``get_input_embeddings()``, a ModuleList of num_codebooks tables). None for a one-stream model."""
    try:
        tables = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a reference that names no input embeddings: one stream
        return None
    return len(tables) if isinstance(tables, torch.nn.ModuleList) and len(tables) >= 2 else None


def several_streams(build) -> bool:
    """Whether the model ``build()`` makes embeds several token streams per position, built on the meta device (no
    weights): a config naming ``num_codebooks`` may count another model's streams (Moshi's audio codebooks beside its
    one-stream text LM)."""
    with torch.device("meta"):
        return streams_of(build()) is not None


def frame_codes(frames: torch.Tensor, streams: int, vocab: int) -> torch.Tensor:
    """[B, S] frame ids -> [B, streams, S] codes: codebook k holds the k-th base-``vocab`` digit."""
    k = torch.arange(streams, device=frames.device)
    return (frames.long()[:, None, :] // vocab ** k[None, :, None]) % vocab


def codebook_rows(codes: torch.Tensor) -> torch.Tensor:
    """[B, streams, S] codes -> transformers' (B x streams, S) input_ids: each batch's codebook rows together."""
    return codes.reshape(-1, codes.shape[-1])


def joint_logits(head_logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, streams, S, vocab] per-head logits -> [B, S, vocab ** streams]: the joint log-probability of each frame id
    (its digits' log-softmax summed over the heads), in float64."""
    streams = head_logits.shape[1]
    logp = torch.log_softmax(head_logits.double(), dim=-1)
    ids = torch.arange(vocab ** streams, device=head_logits.device)
    return sum(logp[:, k][..., (ids // vocab ** k) % vocab] for k in range(streams))


def bind_frames(model):
    """The model's forward over frame ids [B, S] (one stream token per frame) -> logits [B, S, vocab ** streams], in
    place; the model as it was for a one-stream model. Returns the model."""
    streams = streams_of(model)
    if streams is None:
        return model

    # the class's signature kept: the host and the reference ask it which keywords the model takes
    # (encoder_hidden_states for MusicGen's cross-attention, host_model.encoder_kwargs)
    @functools.wraps(type(model).forward)
    def forward(self, input_ids=None, **kwargs):
        vocab = self.config.vocab_size
        rows = codebook_rows(frame_codes(input_ids, streams, vocab))
        # the class's forward, not a captured bound one: a deep copy of the model (reference, model under test) runs
        # its own weights
        out = type(self).forward(self, input_ids=rows, **kwargs)
        b, s = input_ids.shape
        out.logits = joint_logits(out.logits.reshape(b, streams, s, -1), vocab)
        return out

    model.forward = types.MethodType(forward, model)
    return model
