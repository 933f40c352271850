"""host_model.ReferenceMemo: the reference's logits computed once per token sequence (a checkout run asks for the
same sequence up to three times: the comparison, the float32 noise, the comparison at the widened tolerance, and the
reading sweep's rerun once more). It must give what reference_logits gives, per sequence, and nothing shared."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from model_infer_kvcache.validators.checkout_run.run import float32_noise
from model_infer_kvcache.validators.pipeline.host_model import ReferenceMemo, reference_logits


class _Counted(torch.nn.Module):
    """A causal toy (cumulative mean of embeddings, one layer, a head) that counts its forwards."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)
        self.forwards = 0

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, use_cache=False):
        self.forwards += 1
        x = self.emb(input_ids)
        x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]
        return SimpleNamespace(logits=self.head(torch.tanh(self.mix(x))))


def test_the_memo_gives_reference_logits_once_per_sequence():
    model = _Counted()
    memo = ReferenceMemo(model)
    a, b = [1, 2, 3, 4], [4, 3, 2, 1]  # same length, other tokens: keyed by the tokens, not the length
    with torch.no_grad():
        want_a, want_b = reference_logits(model, a), reference_logits(model, b)
    model.forwards = 0
    got_a = memo(a)
    assert torch.equal(got_a, want_a) and torch.equal(memo(b), want_b) and model.forwards == 2
    got_a.fill_(0.0)  # a caller writing into its logits does not change the next caller's
    assert torch.equal(memo(a), want_a) and torch.equal(memo(torch.tensor(a).tolist()), want_a)
    assert model.forwards == 2


def test_the_float32_noise_is_the_same_with_the_memo_s_logits():
    model = _Counted()
    seqs = {0: [1, 5, 9, 2, 7], 1: [3, 3, 8]}
    memo = ReferenceMemo(model)
    with torch.no_grad():
        for seq in seqs.values():
            memo(seq)
    model.forwards = 0
    assert float32_noise(model, seqs, memo) == float32_noise(model, seqs)
    # the float32 side came from the memo: only the float64 copy ran (its forwards count on the copy, not here)
    assert model.forwards == len(seqs)


def test_a_failing_request_s_first_diverging_layer_comes_from_the_comparison_s_forward():
    """The numeric check's reference forward keeps the layer outputs (numeric.NumericTracker._reference): naming the
    first diverging layer of a failing request takes no second forward, and names the layer the host got wrong."""
    from model_infer_kvcache.validators.pipeline.host_model import reference_layer_outputs
    from model_infer_kvcache.validators.pipeline.numeric import NumericTracker, _Rows
    from model_infer_kvcache.validators.pipeline.report import Report
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    seq = [5, 9, 2, 7, 1, 3]
    logits, layers = reference_logits(model, seq), reference_layer_outputs(model, seq)
    layers[1] = layers[1] + 1.0  # the host's layer 1 (and so what follows) left the reference
    layers[2] = layers[2] + 1.0
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    tracker = NumericTracker(model, host=None, atol=1e-5)
    tracker.rows[0] = [_Rows(0, True, list(range(len(seq))), logits + 1.0, layers)]
    report = Report(backend="cpu", deploy_mode="standalone", model_type="llama", manifest_hash="", dtype="float32",
                    tolerance=1e-5)
    tracker.check_numeric(report, {0: seq})
    numeric = next(c for c in report.checks if c.id == "V301")
    assert not numeric.passed and numeric.detail.endswith("first diverging layer 1"), numeric.detail
    assert len(forwards) == 1


def test_a_step_that_accepts_every_draft_shares_its_forward_with_the_next_step_s_first_draft():
    """spec_decode.SpecStream: the judged forward of an all-accepted step runs over the drafts and the bonus token
    (its rows before the last are the step's: the model is causal), which is the sequence the next step's first
    greedy draft is chosen on: next_n + 1 forwards for the two, not next_n + 2, and the same rows as a forward over
    the step's own tokens."""
    from model_infer_kvcache.validators.pipeline.spec_decode import SpecStream

    model, n = _Counted().double(), 2
    stream = SpecStream(model, vocab=32, atol=1e-9, next_n=n)
    stream.tokens[0] = [3, 1, 4, 1, 5]
    drafts = stream.drafts([0], 0)  # request 0 at step 0: every draft accepted (the greedy continuation)
    assert model.forwards == n
    seq = stream.tokens[0] + drafts[0]
    with torch.no_grad():
        rows = reference_logits(model, seq)[-1 - n:]  # what the rendered code should give: the reference itself
    emitted = stream.judge(0, [0], drafts, rows.clone(), {0: slice(0, 1 + n)})
    assert emitted == [drafts[0] + [int(rows[-1].argmax())]] and not stream.wrong_verdicts
    assert stream.worst <= 1e-12 and model.forwards == n + 2  # the direct forward above, and the judged one
    stream.drafts([0], 1)  # the next step's first draft: the judged forward's sequence, read again
    assert model.forwards == n + 2
