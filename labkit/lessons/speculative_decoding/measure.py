"""Notebook 11's measurements: engines with and without speculation on the same step loop,
their decode spans, verify step costs, speed-ups, and the proposers' acceptance.

Timing reads the engine's own step records: a run's decode span runs from the first step without
prefill to the end of the last step, so host time between steps counts, and the controlled
draft's untimed reference run (``LLM._references``) does not.
"""
from __future__ import annotations

import math
import random
import statistics
from collections import Counter

import pandas as pd
import torch

from labkit import check_positive_int
from labkit.engine import LLM, ModelConfig, SamplingParams, SpeculativeConfig, random_model
from labkit.engine.speculative import NgramProposer, expected_tokens_per_step
from labkit.measure.rounds import Spread

MAX_MODEL_LEN = 256  # tokens: every prompt here plus its output fits
# What only counts tokens runs eagerly: capturing an engine's graphs (a full graph per batch
# bucket, piecewise graphs per token bucket) is most of building it on a GPU, and nothing
# counted depends on them. Options given override it.
COUNT_ONLY = {"cudagraph_mode": "none"}
# speedups' columns of the async pair, NaN where it did not run (every k but the largest)
ASYNC_COLUMNS = ("async_relative_cost", "async_predicted", "async_tokens_per_forward",
                 "async_speedup", "async_speedup_low", "async_speedup_high",
                 "async_spec_ms_per_token")


def expected_table(accepts=(0.5, 0.7, 0.8, 0.9), ks=(1, 2, 4, 8)) -> pd.DataFrame:
    """Mean tokens a verify step emits, per acceptance rate (rows) and draft length (columns)."""
    return pd.DataFrame({f"k={k}": [expected_tokens_per_step(a, k) for a in accepts]
                         for k in ks}, index=pd.Index(accepts, name="acceptance"))


def _engine(model, k: int | None, acceptance: float = 1.0, method: str = "controlled",
            **options) -> LLM:
    """An engine with speculation of ``k`` drafts (None: plain decoding), prefix caching off so
    a repeated prompt is computed again, each step's device time recorded on a GPU, warmed up
    by one short request. ``max_model_len`` defaults to 256, the longest request here, so that
    several engines' KV caches and graphs fit side by side on a GPU (each would otherwise size
    its cache for the model's full context)."""
    spec = None if k is None else SpeculativeConfig(method, num_speculative_tokens=k,
                                                    acceptance=acceptance)
    llm = LLM(model, speculative=spec, enable_prefix_caching=False,
              **{"max_model_len": MAX_MODEL_LEN, "device_step_times": True, **options})
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))
    return llm


def decode_span(llm: LLM, prompts, max_tokens: int) -> dict:
    """Generate greedily; the steps after the last prefill: their count, median step time (over
    the steps that replayed a full graph where any did, else over all) and median device time
    of the same steps (None unless the engine records it), the span's seconds, the tokens
    emitted in it and how many steps ran each way (``graphs``: ``StepRecord.graph``, e.g.
    "full verify")."""
    first = len(llm.step_history)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    steps = llm.step_history[first:]
    last_prefill = max((i for i, s in enumerate(steps) if s.stats.num_prefill_tokens), default=-1)
    decode = steps[last_prefill + 1:]
    if not decode:
        raise ValueError("the run had no decode step after its prefills: raise max_tokens")
    emitted = sum(len(o.token_ids) for o in outs) - len(prompts)  # one token each from prefill
    span = decode[-1].end_s - decode[0].start_s
    graphs = Counter(s.graph for s in decode)
    # The step time is a full graph's replay wherever one replayed: the run's last steps, with
    # drafts cut short by max_tokens, take piecewise graphs and would mix two kinds of step.
    full = [s for s in decode if s.graph in ("full", "full verify")] or decode
    on_device = [s.device_s for s in full if s.device_s is not None]
    return {"steps": len(decode), "step_ms": 1e3 * statistics.median(s.duration_s for s in full),
            "device_ms": 1e3 * statistics.median(on_device) if on_device else None,
            "timed_steps": len(full),
            "span_s": span, "tokens_per_s": emitted / span, "emitted": emitted,
            "tokens": [o.token_ids for o in outs],
            "proposed": sum(s.stats.num_spec_proposed for s in decode),
            "graphs": graphs}


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, prompt_len), generator=g).tolist()


def _in_turn(runs, r: int) -> list:
    """Run each of ``runs`` once, starting at a different one each round ``r`` (the results in
    ``runs``' order), so a slow spell of the machine lands on every side of a ratio and no
    measurement always goes first."""
    start = r % len(runs)
    results = {i: runs[i]() for i in [*range(start, len(runs)), *range(start)]}
    return [results[i] for i in range(len(runs))]


def _plain(model, batch: int, async_scheduling: bool = False, **options) -> LLM:
    """A plain engine that runs the loop a speculating one runs by default: the synchronous
    one, each step's accepted tokens read before the next is scheduled (or a step's time would
    mean two things); ``async_scheduling=True`` for the plain engine at its best."""
    return _engine(model, None, max_num_seqs=batch,
                   **{"async_scheduling": async_scheduling, **options})


def step_costs(model, batches=(1, 8, 32), ks=(1, 2, 4, 8), prompt_len: int = 64,
               max_tokens: int = 24, rounds: int = 3, **options) -> pd.DataFrame:
    """Per batch size and k: the median verify step (k + 1 tokens per request, every draft
    accepted, so every step verifies k) over the median plain decode step, each verify run
    paired with a plain run of the same batch right beside it (the same step loop: async
    scheduling off in both, see :func:`_plain`), in shuffled rounds: median and
    range over ``rounds``; and the share of the timed decode steps that replayed a full decode
    graph (``full_decode_share``) and of verify steps a full verify graph
    (``full_verify_share``). Where the engine records device time (a GPU), the same steps on
    the GPU's clock too: ``decode_gpu_ms``, ``verify_gpu_ms`` and their ratio
    ``gpu_relative_cost`` (``gpu_low``-``gpu_high``). On a GPU the engines capture full graphs
    only (``cudagraph_mode="full_decode_only"`` unless ``options`` say otherwise): only full
    graph replays are timed, the piecewise graphs the other steps would take are most of the
    graphs an engine captures, and those few steps run eagerly, untimed."""
    check_positive_int("rounds", rounds)
    if next(model.parameters()).device.type == "cuda":
        options = {"cudagraph_mode": "full_decode_only", **options}
    vocab = model.config.vocab_size
    engines = {k: _engine(model, k, max_num_seqs=max(batches), **options) for k in ks}
    engines[None] = _plain(model, max(batches), **options)
    cells = [(b, k) for b in batches for k in ks]
    ratios = {c: [] for c in cells}
    steps = {c: [] for c in cells}
    graphs = {c: [] for c in cells}
    on_device = {c: [] for c in cells}
    for r in range(rounds):
        for b, k in random.Random(r).sample(cells, len(cells)):
            prompts = prompts_for(b, prompt_len, vocab, seed=r)
            plain, verify = _in_turn((lambda: decode_span(engines[None], prompts, max_tokens),
                                      lambda: decode_span(engines[k], prompts, max_tokens)), r)
            ratios[(b, k)].append(verify["step_ms"] / plain["step_ms"])
            steps[(b, k)].append((plain["step_ms"], verify["step_ms"]))
            if plain["device_ms"] is not None and verify["device_ms"] is not None:
                on_device[(b, k)].append((plain["device_ms"], verify["device_ms"]))
            graphs[(b, k)].append((plain["graphs"], verify["graphs"]))
    rows = []
    for b, k in cells:
        ratio = Spread.of(ratios[(b, k)])
        plain_graphs = sum((p for p, _ in graphs[(b, k)]), Counter())
        verify_graphs = sum((v for _, v in graphs[(b, k)]), Counter())
        rows.append({"batch": b, "k": k,
                     "decode_ms": statistics.median(p for p, _ in steps[(b, k)]),
                     "verify_ms": statistics.median(v for _, v in steps[(b, k)]),
                     "relative_cost": ratio.median, "low": ratio.low, "high": ratio.high,
                     "full_decode_share": plain_graphs["full"] / plain_graphs.total(),
                     "full_verify_share": verify_graphs["full verify"] / verify_graphs.total()})
        if on_device[(b, k)]:  # the same steps on the GPU's clock: what the wall time hides
            gpu = Spread.of([v / p for p, v in on_device[(b, k)]])
            rows[-1] |= {"decode_gpu_ms": statistics.median(p for p, _ in on_device[(b, k)]),
                         "verify_gpu_ms": statistics.median(v for _, v in on_device[(b, k)]),
                         "gpu_relative_cost": gpu.median, "gpu_low": gpu.low,
                         "gpu_high": gpu.high}
    return pd.DataFrame(rows)


def speedups(model, accepts=(0.5, 0.8, 1.0), ks=(2, 4), batch: int = 1, prompt_len: int = 64,
             max_tokens: int = 320, rounds: int = 3, versus_async: bool | None = None,
             **options) -> pd.DataFrame:
    """Output tokens/s with the controlled draft at each (acceptance, k) over plain decoding
    with the same step loop (:func:`_plain`), next to the prediction: the formula's tokens per
    step over the relative step cost (verify step over decode step, from the same runs). With
    ``versus_async`` (default: on a GPU) plain decoding with async scheduling runs too, giving
    ``versus_async``: the speed-up over the plain engine's own best loop; and for the largest k
    the speculating engine with async scheduling as well (each step planned before the last
    one's accepted count is read) gives ``async_speedup``: async against async, beside its
    prediction from the two async loops' periods, span over steps (``async_predicted``; NaN for
    the other k). An async step's own record runs from its launch to its tokens' read, past the
    next step's launch, so its duration is not what it costs the loop.

    Each round generates one workload on every engine, in an order shuffled by round, and
    every ratio is of two runs in the same round; an untimed round first compiles and captures
    what a long run needs (an engine's own warm-up request is too short to verify drafts).
    A run is long (``max_tokens``, at most what the model's context leaves after the prompt)
    because the controlled draft's coins make its tokens per step a sample mean: at a = 0.8
    and k = 4 one step's tokens have a standard deviation of about 1.6, about 9% of their mean
    over 30 steps and 5% over 100, and a shorter run would put that luck into every round's
    ratio."""
    vocab = model.config.vocab_size
    # at most what the model's context leaves after the prompt (the tiny model's is 256)
    max_tokens = min(max_tokens, model.config.max_position_embeddings - prompt_len)
    options = {"max_model_len": prompt_len + max_tokens, **options}
    cells = [(a, k) for a in accepts for k in ks]
    engines = {cell: _engine(model, cell[1], acceptance=cell[0], max_num_seqs=batch, **options)
               for cell in cells}
    plain_engine = _plain(model, batch, **options)
    if versus_async is None:
        versus_async = plain_engine.device.type == "cuda"
    async_engine = _plain(model, batch, async_scheduling=True, **options) if versus_async else None
    overlapped = {cell: _engine(model, cell[1], acceptance=cell[0], max_num_seqs=batch,
                                **{"async_scheduling": True, **options})
                  for cell in cells if versus_async and cell[1] == max(ks)}
    named = {"plain": plain_engine, **{("sync", c): e for c, e in engines.items()},
             **{("async", c): e for c, e in overlapped.items()}}
    if async_engine is not None:
        named["async plain"] = async_engine
    done = []  # per round: engine name -> its decode_span
    for r in range(-1, rounds):  # round -1 warms up: graphs and kernels a verify row first needs
        prompts = prompts_for(batch, prompt_len, vocab, seed=100 + r)
        order = random.Random(r).sample(list(named), len(named))
        spans = {name: decode_span(named[name], prompts, max_tokens) for name in order}
        if r >= 0:
            done.append(spans)
    rows = []
    for a, k in cells:
        pairs = [(run["plain"], run[("sync", (a, k))]) for run in done]
        speed = Spread.of([s["tokens_per_s"] / p["tokens_per_s"] for p, s in pairs])
        cost = Spread.of([s["step_ms"] / p["step_ms"] for p, s in pairs])
        per_forward = sum(s["emitted"] for _, s in pairs) / sum(s["steps"] for _, s in pairs)
        expected = expected_tokens_per_step(a, k)
        row = {"acceptance": a, "k": k, "tokens_per_forward": per_forward,
               "expected_tokens": expected, "relative_cost": cost.median,
               "predicted": expected / cost.median,
               "speedup": speed.median, "low": speed.low, "high": speed.high,
               "same_tokens": all(s["tokens"] == p["tokens"] for p, s in pairs),
               # what each ratio is made of: ms per output token, median over the rounds
               "plain_ms_per_token": _ms_per_token(p for p, _ in pairs),
               "spec_ms_per_token": _ms_per_token(s for _, s in pairs)}
        if async_engine is not None:
            fast = Spread.of([s["tokens_per_s"] / run["async plain"]["tokens_per_s"]
                              for run, (_, s) in zip(done, pairs)])
            row |= {"versus_async": fast.median, "versus_async_low": fast.low,
                    "versus_async_high": fast.high,
                    "async_ms_per_token": _ms_per_token(run["async plain"] for run in done)}
            if (a, k) in overlapped:
                quads = [(run["async plain"], run[("async", (a, k))]) for run in done]
                both = Spread.of([s["tokens_per_s"] / q["tokens_per_s"] for q, s in quads])
                # with a step always in flight a step's record spans two steps of the loop:
                # the loop's period (span over steps) is what each step costs it
                async_cost = Spread.of([_period(s) / _period(q) for q, s in quads]).median
                row |= {"async_relative_cost": async_cost,
                        "async_predicted": expected / async_cost,
                        "async_tokens_per_forward": sum(s["emitted"] for _, s in quads)
                        / sum(s["steps"] for _, s in quads),
                        "async_speedup": both.median, "async_speedup_low": both.low,
                        "async_speedup_high": both.high,
                        "async_spec_ms_per_token": _ms_per_token(s for _, s in quads),
                        "async_same_tokens": all(s["tokens"] == p["tokens"]
                                                 for (p, _), (_, s) in zip(pairs, quads))}
            else:  # measured for the largest k only
                row |= dict.fromkeys(ASYNC_COLUMNS, math.nan) | {"async_same_tokens": True}
        rows.append(row)
    return pd.DataFrame(rows)


def _period(run: dict) -> float:
    """A ``decode_span`` run's seconds per step: its span over its steps."""
    return run["span_s"] / run["steps"]


def _ms_per_token(runs) -> float:
    """The median over ``runs`` (``decode_span`` results) of milliseconds per output token."""
    return statistics.median(1e3 / run["tokens_per_s"] for run in runs)


def acceptance_check(model, accepts=(0.5, 0.8, 0.9), ks=(1, 2, 4), batch: int = 16,
                     prompt_len: int = 16, max_tokens: int = 40, **options) -> pd.DataFrame:
    """The controlled draft's emitted tokens per verify against (1 - a^(k+1)) / (1 - a), over
    ``batch`` requests (hundreds of verifies per setting). Verifies near a request's end propose
    fewer than k tokens, so only full-length ones count: a request's budget, not the draft,
    would cut those short. Eager (``COUNT_ONLY``) unless ``options`` say otherwise."""
    options = {**COUNT_ONLY, **options}
    vocab = model.config.vocab_size
    prompts = prompts_for(batch, prompt_len, vocab, seed=3)
    rows = []
    for a in accepts:
        for k in ks:
            llm = _engine(model, k, acceptance=a, max_num_seqs=batch, **options)
            outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
            emitted = [n for o in outs for n in full_verifies(o, k, max_tokens)]
            rows.append({"acceptance": a, "k": k, "verifies": len(emitted),
                         "tokens_per_verify": sum(emitted) / len(emitted),
                         "expected": expected_tokens_per_step(a, k)})
    return pd.DataFrame(rows)


def tokens_per_step(output) -> list[int]:
    """How many tokens each step emitted for one request: a step's tokens share its time stamp
    (``RequestOutput.token_times_s``); the first is the prefill's."""
    counts: list[int] = []
    last = None
    for t in output.token_times_s:
        if t == last:
            counts[-1] += 1
        else:
            counts.append(1)
            last = t
    return counts


def full_verifies(output, k: int, max_tokens: int) -> list[int]:
    """Tokens emitted by each verify step of ``output`` that had room for all k drafts and the
    target's token (``max_tokens`` minus the tokens already out is at least k + 1)."""
    counts, out = tokens_per_step(output), []
    done = counts[0] if counts else 0
    for n in counts[1:]:
        if max_tokens - done >= k + 1:
            out.append(n)
        done += n
    return out


def repeating_prompts(batch: int, vocab: int, passage_len: int = 24, seed: int = 0
                      ) -> list[list[int]]:
    """Prompts that quote a passage twice, so its continuation can be looked up in the prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        passage = torch.randint(1, vocab, (passage_len,), generator=g).tolist()
        out.append(passage + passage + passage[: passage_len // 2])
    return out


def _spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.stats
    return s.num_spec_verifies, s.num_spec_proposed, s.num_spec_accepted


def lookup_hits(prompt: list[int], output: list[int], min_n: int = 1, max_n: int = 3) -> int:
    """How many output tokens prompt lookup would have guessed: at each output position, the
    token that followed the latest earlier occurrence of the longest suffix n-gram (the
    proposer's first draft token) equals the token the model produced. This bounds what lookup
    can find in that text, whatever k is; the engine proposes once per verify step, not per
    token, so its acceptance follows this share without equalling it."""
    first = NgramProposer(min_n, max_n, 1)
    tokens = list(prompt)
    hits = 0
    for token in output:
        hits += first.propose(tokens) == [token]
        tokens.append(token)
    return hits


def lookup_models(model) -> dict:
    """The notebook's model, and beside it the tiny random model (256-token vocabulary) unless
    that is the model already: random models differ in how soon they fall into loops, which is
    all lookup can find in their output. Keys name each model's shape."""
    def label(m):
        c = m.config
        return f"{c.num_hidden_layers} layers, width {c.hidden_size}, vocab {c.vocab_size}"
    models = {label(model): model}
    small = ModelConfig.tiny()
    if model.config != small:
        tiny = random_model(small, seed=0, device=next(model.parameters()).device)
        models[label(tiny)] = tiny
    return models


def ngram_acceptance(models, k: int = 4, batch: int = 4, max_tokens: int = 48, **options
                     ) -> pd.DataFrame:
    """The n-gram proposer on prompts that repeat a passage and on plain random prompts, for
    each model (one model, or a dict of name -> model): drafts proposed and accepted, the share
    of output tokens an earlier n-gram's continuation predicts (``repeats``, from
    :func:`lookup_hits`), and whether the outputs equal a plain engine's. Random weights do not
    continue a quoted passage; whether a random model falls into loops of its own depends on the
    model, and ``repeats`` measures it: what this shows is the mechanism, not lookup's gain on
    real text. Eager (``COUNT_ONLY``) unless ``options`` say otherwise."""
    options = {**COUNT_ONLY, **options}
    if not isinstance(models, dict):
        models = {"model": models}
    spec = SpeculativeConfig("ngram", num_speculative_tokens=k)
    rows = []
    for label, model in models.items():
        vocab = model.config.vocab_size
        for name, prompts in (("repeating passage", repeating_prompts(batch, vocab)),
                              ("plain random", prompts_for(batch, 60, vocab, seed=7))):
            llm = _engine(model, k, method="ngram", max_num_seqs=batch, **options)
            plain = _engine(model, None, max_num_seqs=batch, **options)
            before = _spec_counts(llm)
            outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
            expected = plain.generate(prompts, SamplingParams(max_tokens=max_tokens))
            verifies, proposed, accepted = (a - b for a, b in zip(_spec_counts(llm), before))
            tokens = sum(len(o.token_ids) for o in outs)
            hits = sum(lookup_hits(p, o.token_ids, spec.min_n, spec.max_n)
                       for p, o in zip(prompts, outs))
            rows.append({"model": label, "workload": name, "verifies": verifies,
                         "proposed": proposed, "accepted": accepted,
                         "acceptance": accepted / proposed if proposed else float("nan"),
                         "tokens": tokens, "repeats": hits / tokens if tokens else float("nan"),
                         "same_tokens": [o.token_ids for o in outs] == [o.token_ids
                                                                        for o in expected]})
    return pd.DataFrame(rows).set_index(["model", "workload"])


def draft_acceptance(model, k: int = 4, batch: int = 4, max_tokens: int = 24, seed: int = 1,
                     **options) -> dict:
    """A draft model of the target's shape cut to one layer, random weights of its own seed,
    proposing for the target (``SpeculativeConfig("draft", ...)``): drafts proposed and
    accepted, and whether the outputs equal a plain engine's. Eager (``COUNT_ONLY``) unless
    ``options`` say otherwise."""
    from dataclasses import replace
    options = {**COUNT_ONLY, **options}
    draft = random_model(replace(model.config, num_hidden_layers=1), seed=seed,
                         device=next(model.parameters()).device,
                         dtype=next(model.parameters()).dtype)
    prompts = prompts_for(batch, 32, model.config.vocab_size, seed=11)
    spec = SpeculativeConfig("draft", num_speculative_tokens=k, draft_model=draft)
    llm = LLM(model, speculative=spec, enable_prefix_caching=False,
              **{"max_model_len": MAX_MODEL_LEN, "max_num_seqs": batch, **options})
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    plain = _engine(model, None, max_num_seqs=batch, **options)
    expected = plain.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return {"proposed": llm.stats.num_spec_proposed, "accepted": llm.stats.num_spec_accepted,
            "same_tokens": [o.token_ids for o in outs] == [o.token_ids for o in expected]}
