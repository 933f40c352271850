"""The device-readings vocabulary: the open device questions and the readings each can have (torch-free).

references/device_questions.md explains the questions; this module is their one definition. The
probe answers them (``validators.probe``), the readings file records the answers, the manifest lists
the ones a design rests on (``DeviceDependency.question``), and the emulator's switches
(``validators.npu_ops.DeviceReadings``) take the same names and values. Adding a question is one
``Question(...)`` entry here (plus a field of ``DeviceReadings`` when it is an emulator switch;
``tests/test_probe.py`` checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass

UNKNOWN = "unknown"  # the probe's output matched none of the question's readings
# Where the operators run: the device, or the CPU emulation (a dry run that settles no device question).
OP_BACKENDS = ("npu", "emulated")
BACKEND_CHOICES = ("auto", *sorted(OP_BACKENDS))  # validation: auto picks npu when torch_npu is present


@dataclass(frozen=True)
class Question:
    name: str
    # readings[0]: assumed until measured; the documented reading, or what upstream code relies on
    # where the two disagree (the sweep then reports the model's dependency on it)
    readings: tuple[str, ...]
    asks: str
    meaning: str  # what each reading means, one line
    switch: bool = False  # an emulator switch: validate can run the emulator under the measured reading
    dependency: bool = False  # a design can rest on it: the manifest lists it under device_dependencies
    # validate re-runs under the other readings when not measured: a dependency question when the
    # manifest lists it, an operator question (dependency=False) when the run consulted it (a call
    # whose result depends on the reading: ``validators.npu_ops.readings.consult``)
    swept: bool = False
    # A dependency question validation does not sweep: why a rerun under its other readings could not tell the
    # code apart (the report says this instead of a verdict; references/validation.md repeats it)
    unswept: str = ""

    @property
    def default(self) -> str:
        return self.readings[0]

    def alternatives(self, reading: str) -> tuple[str, ...]:
        return tuple(r for r in self.readings if r != reading)


QUESTIONS: dict[str, Question] = {q.name: q for q in (
    Question("band_at_single_query", ("honoured", "ignored"),
             "is the sparse_mode 4 band (pre_tokens) applied to a query of length 1 (paged TND decode)?",
             "honoured: a q_len-1 request is masked like any other (causal modes, the mode-4 band, the mode-0 "
             "window); ignored: sparse_mode and pre/next_tokens have no effect at q_len 1, as the op docs say",
             switch=True, dependency=True, swept=True),
    Question("window_pre_tokens", ("exclusive", "inclusive"),
             "does pre_tokens count only the keys before the query (W+1 visible) or the query too (W)?",
             "exclusive: the documented band rule i'-pre_tokens <= j <= i'+next_tokens (pre_tokens=W admits "
             "W+1 keys); inclusive: pre_tokens counts the query itself (W keys, the HF / vLLM window)",
             switch=True, dependency=True, swept=True),
    Question("null_block_contents", ("stale", "zeros", "poisoned"),
             "what does a never-written block of a cache allocated like the framework's (torch.empty) hold?",
             "stale (what the memory held before: torch.empty's contract) / zeros / poisoned (NaN, as validation "
             "fills never-written blocks)",
             dependency=True,
             unswept="not an emulator switch: validation poisons the null block and every freed or never-written "
                     "block with NaN, the strictest contents (any read shows up), so stale or zero contents could "
                     "only hide a read the poisoned run already fails"),
    Question("repeated_slots", ("last_wins", "first_wins", "error"),
             "do the cache writers accept padded decode rows that all write the null block's slot 0?",
             "last_wins / first_wins: the slot holds the last / first row written to it; error: the writer "
             "rejects any repeated slot",
             switch=True, dependency=True,
             unswept="the padded rows write only the null block, which is poisoned with NaN after every write, so "
                     "last_wins and first_wins leave the same (poisoned) block; under 'error' every padded decode "
                     "step fails whatever the code, since the engine pads the batch, not the model; repeats "
                     "outside the null block are refused under every reading; only `kvcache probe` on the NPU "
                     "settles it"),
    Question("finalize_skip1_alone", ("added", "ignored", "rejected"),
             "does npu_moe_finalize_routing add skip1 when skip2 is None (the doc requires skip1 None then)?",
             "added: out = skip1 + the weighted expert rows (what upstream DeepSeek's prefill MoE relies on); "
             "ignored: skip1 is dropped; rejected: the op refuses the call, as the torch-npu 2.9.0 doc says",
             switch=True, swept=True),
    Question("mla_decode_sparse_mode3", ("same_as_mode0", "deviates", "rejected"),
             "MLA absorb decode (q_len 1, rope inputs) with sparse_mode 3: same as mode 0, different, or refused?",
             "same_as_mode0: sparse_mode 3 with the mask sees the keys mode 0 sees and gives its output (what "
             "upstream kimi_k2_thinking's decode relies on); deviates: it does not (the seed skill's report; "
             "emulated as the mask read from its top-left corner); rejected: the op refuses the call, as the "
             "op docs' supported combinations imply",
             switch=True, swept=True),
    Question("gdr_state_writes", ("every_token", "last_only"),
             "npu_recurrent_gated_delta_rule: is every token's state written to its ssm_state_indices slot, or only "
             "the request's final state?",
             "every_token: the state after token i goes to state[ssm_state_indices[i]] (the doc's per-token wording, "
             "vLLM's fused_recurrent kernel); last_only: only the final state is written, to the last token's slot",
             switch=True, swept=True),
    Question("gdr_accepted_start", ("accepted_slot", "first_slot"),
             "npu_recurrent_gated_delta_rule with num_accepted_tokens: which slot does a request's recurrence start from?",
             "accepted_slot: state[ssm_state_indices[start + num_accepted_tokens - 1]] (the slot the previous step "
             "wrote for its last accepted token, vLLM's kernel); first_slot: the slot of its first token, whatever "
             "num_accepted_tokens says",
             switch=True, swept=True),
    Question("gdr_head_grouping", ("consecutive", "strided"),
             "gated delta rule ops with Nv > Nk: which query/key head serves value head h?",
             "consecutive: key head h // (Nv/Nk) (repeat_interleave: transformers, FLA, vLLM, upstream qwen3_5's "
             "torch fallback); strided: key head h % Nk (repeat/tile)",
             switch=True, swept=True, dependency=True),
    Question("value_head_dim", ("documented_pairs", "equal_only"),
             "FA over packed (TND) queries with value heads narrower than key heads (Q_D = K_D = 192, V_D = 128)?",
             "documented_pairs: the op takes the (K_D, V_D) pairs its TND section lists (2.14.0 "
             "_op_plugin_docs.py:8730, what MiMo-V2-Flash's plan rests on); equal_only: key and value shapes must be "
             "identical, as the same doc's general rule says (:8685), and the call fails",
             switch=True, swept=True, dependency=True),
)}

# The names as tuples, for Literal[...] fields and argparse choices.
QUESTION_NAMES = tuple(QUESTIONS)
DEPENDENCY_QUESTIONS = tuple(q.name for q in QUESTIONS.values() if q.dependency)
SWITCH_QUESTIONS = tuple(q.name for q in QUESTIONS.values() if q.switch)


def reading_ok(question: str, reading: str) -> bool:
    return reading == UNKNOWN or reading in QUESTIONS[question].readings
