"""Notebook 07's exercises: what a decode step costs, and what goes into the next step.

07.1: ``decode_step_cost(config, batch, context, dtype_bytes)``, the FLOPs, weight bytes and
KV bytes of one decode step, checked against ``prefill_decode.forward_cost`` (the arithmetic
behind the notebook's roofline) on random model shapes: MHA, GQA and MQA, batch 1, context 1.

07.2: ``plan_step(decoding, prefilling, waiting, max_num_batched_tokens, max_num_seqs)``, the
rows of the next step with chunked prefill, checked against the engine's own ``Scheduler``
driven into random situations (decodes running, a prompt half prefilled, prompts waiting).
"""
from __future__ import annotations

import random

from labkit.lessons.prefill_vs_decode import cost as pdc
from labkit.engine.config import ModelConfig
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.teaching.exercises import Case, Exercise
from labkit.kvcache import BlockManager

COST_KEYS = ("flops", "weight_bytes", "kv_bytes")


# --- 07.1 the arithmetic of a decode step -----------------------------------------------------
def _random_config(rng: random.Random, kind: str) -> ModelConfig:
    head_dim = rng.choice([32, 64, 128])
    heads = rng.choice([4, 8, 16])
    kv_heads = {"MHA": heads, "GQA": heads // rng.choice([2, 4]), "MQA": 1}[kind]
    return ModelConfig(hidden_size=heads * head_dim + rng.choice([0, 64]),  # q_size may differ
                       intermediate_size=rng.randrange(2, 6) * 128 + rng.choice([0, 40]),
                       num_hidden_layers=rng.randrange(1, 9), num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim,
                       vocab_size=rng.randrange(500, 40000))


def _cost_cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    shapes = [
        ("GQA, batch 1, context 1 (only the new token)", "GQA", 1, 1, 2),
        ("GQA, a batch of 16, context not a multiple of anything", "GQA", 16,
         rng.randrange(300, 3000) | 1, 2),
        ("MHA (one KV head per query head), float32", "MHA", rng.randrange(2, 9),
         rng.randrange(100, 1000), 4),
        ("MQA (one KV head for all), a large batch", "MQA", rng.randrange(100, 300),
         rng.randrange(500, 5000), 2),
        ("GQA, fp8 (1 byte per number), long context", "GQA", rng.randrange(2, 40),
         rng.randrange(8000, 32000), 1),
        ("the notebook's bench_1b, batch 64, context 4096", None, 64, 4096, 2),
    ]
    cases = []
    for label, kind, batch, context, dtype_bytes in shapes:
        config = ModelConfig.bench_1b() if kind is None else _random_config(rng, kind)
        c = config
        label += (f": {c.num_hidden_layers} layers, width {c.hidden_size}, {c.num_attention_heads}"
                  f" query / {c.num_key_value_heads} KV heads of {c.head_dim}, batch {batch}, "
                  f"context {context}, {dtype_bytes} B per number")
        cases.append(Case(label, (config, batch, context, dtype_bytes)))
    return cases


def _cost_run(fn, case: Case) -> dict:
    out = fn(*case.args)
    if not isinstance(out, dict):
        raise TypeError(f"decode_step_cost should return a dict with keys {list(COST_KEYS)}, "
                        f"got {type(out).__name__}")
    return {k: out.get(k) for k in COST_KEYS}


def _cost_expected(case: Case) -> dict:
    config, batch, context, dtype_bytes = case.args
    cost = pdc.forward_cost(config, pdc.decode(batch, context), dtype_bytes)
    return {"flops": cost["linear_flops"] + cost["attention_flops"],
            "weight_bytes": cost["weight_bytes"], "kv_bytes": cost["kv_bytes"]}


def _cost_diagnose(case: Case, got: dict, expected: dict) -> str | None:
    c, B, C, e = case.args
    h, L, V, D = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.head_dim
    Hq, Hkv = c.num_attention_heads, c.num_key_value_heads
    flops, wbytes, kvbytes = (got.get(k) for k in COST_KEYS)
    want_f, want_w, want_kv = (expected[k] for k in COST_KEYS)
    attention = 4 * Hq * D * L * B * C
    if flops != want_f and isinstance(flops, (int, float)):
        if 2 * flops == want_f:
            return "FLOPs are half: a multiply-add is 2 FLOPs (a matmul of m x k by k x n is 2mkn)."
        if flops == want_f - attention:
            return ("FLOPs lack attention: each row's query meets all `context` keys (QK^T) and "
                    "their values (PV): 4 * num_attention_heads * head_dim FLOPs per (query, key) "
                    "pair, per layer.")
        if flops == want_f - attention + 4 * Hkv * D * L * B * C:
            return ("Attention FLOPs counted per KV head: every query head does its own QK^T and "
                    "PV, so count num_attention_heads; GQA saves bytes, not FLOPs.")
        if flops == want_f - 2 * B * V * h:
            return ("FLOPs lack the LM head: each row's hidden state times [hidden, vocab] at "
                    "the end.")
    if wbytes != want_w and isinstance(wbytes, (int, float)):
        if wbytes == B * want_w:
            return ("Weight bytes grow with the batch in your answer: the weights are read once "
                    "per step and serve every row. That is the whole point of batching decode.")
        if wbytes == want_w - e * (2 * L + 1) * h:
            return ("Weight bytes lack the RMSNorm weights: two vectors of hidden_size per layer "
                    "and one final one (config.num_parameters() counts them).")
        if wbytes == want_w - e * V * h:
            return "Weight bytes lack the LM head ([vocab, hidden], read whole every step)."
        if wbytes == want_w + e * V * h:
            return ("Weight bytes include the embedding table: a step reads only one row of it "
                    "per token. Leave it out (the LM head, a separate matrix, is read whole).")
    if kvbytes != want_kv and isinstance(kvbytes, (int, float)):
        per_token = e * L * 2 * c.kv_size
        if kvbytes == per_token * B * C:
            return ("KV bytes count the reads of the cache but not the write of the new token's "
                    "K and V: each row reads `context` tokens and writes one.")
        if kvbytes == e * L * 2 * c.q_size * B * (C + 1):
            return ("KV bytes counted with the query heads: only num_key_value_heads heads are "
                    "cached (kv_size = num_key_value_heads * head_dim): that is what GQA saves.")
        if kvbytes == per_token * (C + 1):
            return "KV bytes count one row: every row of the batch has its own cache to read."
        if kvbytes == per_token // 2 * B * (C + 1):
            return "KV bytes count K or V, not both: each cached token has a key and a value."
    return None


# --- 07.2 the next step with chunked prefill --------------------------------------------------
class _Situation:
    """A real Scheduler driven into a state; ``case()`` snapshots it and schedules one step."""

    def __init__(self, budget: int, max_num_seqs: int):
        self.sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                            max_model_len=8192, enable_chunked_prefill=True),
            BlockManager(4096, 16, enable_prefix_caching=False))
        self._n = 0

    def add(self, *prompt_lens: int) -> "_Situation":
        for n in prompt_lens:
            self._n += 1
            self.sched.add_request(f"r{self._n}", [7] * n, max_tokens=1000)
        return self

    def steps(self, n: int) -> "_Situation":
        for _ in range(n):
            step = self.sched.schedule()
            self.sched.update(step, [1] * step.num_sampled)
        return self

    def case(self, label: str) -> Case:
        s = self.sched
        decoding = [r.request_id for r in s.running if r.is_decode]
        prefilling = [(r.request_id, r.num_tokens - r.num_computed_tokens) for r in s.running
                      if not r.is_decode]
        waiting = [(r.request_id, r.num_tokens) for r in s.waiting]
        budget, seqs = s.config.max_num_batched_tokens, s.config.max_num_seqs
        rows = [(r.request_id, r.num_tokens) for r in s.schedule().rows]
        label += (f" ({len(decoding)} decoding, {len(prefilling)} mid-prefill, {len(waiting)} "
                  f"waiting; budget {budget}, max_num_seqs {seqs})")
        return Case(label, (decoding, prefilling, waiting, budget, seqs), {"expected": rows})


def _plan_cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    budget = rng.choice([32, 48, 64])
    k = rng.randrange(2, 6)
    short = [rng.randrange(1, 8) for _ in range(k)]  # all admitted in one or two steps
    chunk = budget - k                                # what the decodes leave each step
    full_steps = rng.randrange(3, 6)
    long = full_steps * chunk + rng.randrange(1, chunk - 1)  # its last chunk leaves room

    def decoding(seqs: int = 16) -> _Situation:
        return _Situation(budget, seqs).add(*short).steps(2)

    return [
        decoding().case("decodes only, nobody waiting"),
        decoding().add(long).case(f"a {long}-token prompt arrives while requests decode"),
        decoding().add(long).steps(rng.randrange(1, full_steps)).add(rng.randrange(1, budget))
        .case("the long prompt is partly prefilled; a short prompt waits behind it"),
        decoding().add(long).steps(full_steps).add(rng.randrange(2, budget))
        .case("the long prompt's last chunk, then a short prompt in the tokens left"),
        _Situation(budget, 16).add(budget - 3, 3 + rng.randrange(1, budget), rng.randrange(1, 5))
        .case("three prompts arrive at once, nothing running: the second is cut to the 3 "
              "tokens left"),
        decoding(seqs=k).add(rng.randrange(1, budget)).case(
            "max_num_seqs requests already run: the budget has room, the batch does not"),
        _Situation(budget, 16).add(*[1] * rng.randrange(2, 5)).steps(1).add(1, 1).case(
            "one-token prompts"),
        _Situation(budget, 16).case("no requests at all"),
    ]


def _plan_run(fn, case: Case) -> dict:
    rows = fn(*case.args)
    if isinstance(rows, (list, tuple)):  # anything else: compare() says what it is
        rows = [tuple(r) if isinstance(r, (list, tuple)) else r for r in rows]
    return {"rows": rows}


def _plan_diagnose(case: Case, got: dict, expected: dict) -> str | None:
    decoding, prefilling, waiting, budget, max_seqs = case.args
    rows, want = got.get("rows"), expected["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, tuple) and len(r) == 2
                                             and isinstance(r[1], int) for r in rows):
        return "Return a list of (request_id, num_tokens) pairs, one per row of the step."
    left = dict(prefilling) | dict(waiting)
    total = sum(n for _, n in rows)
    if total > budget:
        return (f"Your step holds {total} tokens; max_num_batched_tokens is {budget}. Every row "
                "after the decodes gets min(its tokens left, the budget left).")
    decodes = [(r, n) for r, n in rows if r in decoding]
    if [r for r, _ in decodes] != decoding or any(n != 1 for _, n in decodes) or \
            rows[:len(decoding)] != [(r, 1) for r in decoding]:
        return ("Every decoding request gets exactly one token, and they come first: they are the "
                "users already watching tokens stream in, so their next token is never delayed "
                "behind a prompt.")
    wait_ids = [r for r, _ in waiting]
    admitted = [r for r, _ in rows if r in wait_ids]
    running = len(decoding) + len(prefilling)
    if running + len(admitted) > max_seqs:
        return (f"{running} requests are running and max_num_seqs is {max_seqs}: admit a waiting "
                f"prompt only while fewer than {max_seqs} run (you admitted {len(admitted)}).")
    if admitted != wait_ids[:len(admitted)]:
        return "Admit waiting prompts first come, first served: in the order of `waiting`."
    place = {r: i for i, (r, _) in enumerate(rows)}
    if any(place[p] > place[a] for p, _ in prefilling if p in place for a in admitted):
        return ("A prompt already being prefilled continues before new prompts are admitted: it "
                "holds KV blocks and a place in the batch already.")
    for r, n in rows:
        if r in left and n > left[r]:
            return f"{r} has only {left[r]} tokens left to compute; you gave it {n}."
        if r in left and n == left[r] and (r, n) not in want:
            return (f"{r}'s {left[r]} tokens do not all fit in the budget left: chunked prefill "
                    "gives it what fits now (min(tokens left, budget left)) and the rest in later "
                    "steps.")
    if total < sum(n for _, n in want):
        return (f"Your step holds {total} tokens and leaves {budget - total} of the budget unused "
                "while a prompt still has tokens to compute: fill the step, cutting the last "
                "prompt into a chunk.")
    return None


EXERCISES = [
    Exercise(
        id="07.1", title="the arithmetic of a decode step", entry="decode_step_cost",
        task="return the FLOPs, weight bytes and KV bytes of one decode step",
        cases=_cost_cases, run=_cost_run, expected=_cost_expected, diagnose=_cost_diagnose,
        hints=(
            "A decode step computes one token for each of `batch` rows. Linear layers: 2 FLOPs per "
            "weight per token. Per layer the weights are q, k, v and o "
            "(`h*(q_size + 2*kv_size) + q_size*h`) and the MLP's three matrices (`3*h*i`); the "
            "LM head (`vocab*h`) runs once per row too.",
            "Attention: each query head of each row meets `context` keys: QK^T and PV are 2 FLOPs "
            "each per (query, key) pair per head_dim, so `4 * num_attention_heads * head_dim * "
            "context` per row and layer.",
            "Bytes: every weight once per step, whatever the batch: "
            "`config.num_parameters() - vocab*hidden` (all but the embedding table, of which a "
            "step reads one row per token) times dtype_bytes. KV: per row and layer, read "
            "`context` tokens of K and V (`2 * kv_size` numbers each) and write the new one: "
            "`dtype_bytes * layers * 2 * kv_size * batch * (context + 1)`.",
        ),
        seen="FLOPs grow with the batch, weight bytes do not: that is why a batch-1 decode step "
             "does about 1 FLOP per byte and batching moves it right on the roofline. KV bytes "
             "grow with batch times context and are divided by the GQA group (query heads per KV "
             "head), while attention FLOPs are not: past some batch each new row adds as many "
             "bytes as FLOPs, which is why long-context decode never reaches the ridge "
             "(`knee_batch` in `labkit/lessons/prefill_vs_decode/cost.py` searches for it with this arithmetic).",
    ),
    Exercise(
        id="07.2", title="what goes into the next step (chunked prefill)", entry="plan_step",
        task="return the next step's rows as (request_id, num_tokens) pairs, in the order the "
             "scheduler fills them",
        cases=_plan_cases, run=_plan_run, expected=lambda c: {"rows": c.kwargs["expected"]},
        diagnose=_plan_diagnose,
        hints=(
            "Three groups, in this order: every decoding request (1 token each), then requests "
            "mid-prefill (their next chunk), then waiting prompts, first come first served. Keep "
            "a `budget` of tokens left and subtract as you go.",
            "A prefill row gets `min(tokens left, budget left)`; stop when the budget is 0. A "
            "waiting prompt is admitted only while fewer than `max_num_seqs` requests run (the "
            "decoding and mid-prefill ones count, and so does each one you admit).",
            "Nothing else decides here: the KV cache has room for everyone and prefix caching is "
            "off. Return `[]` when nothing runs and nothing waits.",
        ),
        seen="Decodes are never delayed, a long prompt is cut to whatever the budget leaves beside "
             "them, and a prompt in the middle of its prefill continues before a new one starts. "
             "This is steps 1-3 of `Scheduler.schedule` in `labkit/engine/scheduler.py` (which "
             "also handles running out of KV blocks and the prefix cache). The budget is the dial "
             "of part 4: small, and every step stays short but a long prompt takes many steps; "
             "large, and decodes wait behind whole prompts.",
    ),
]
