"""The embedded engine's scheduler and runner, in process: batching, sampling, logprobs, stops, pauses."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch

from agentrl.engine.native_api import Completion, GenerateInput, parse_sampling_params
from agentrl.engine.scheduler import Request, Scheduler
from tests.conftest_engine import max_abs_diff

VOCAB = 1 << 16  # ids are range-checked against this; the tiny model's vocabulary is smaller


class Waiter:
    def __init__(self):
        self.done = threading.Event()
        self.result: Completion | None = None
        self.updates: list[Completion] = []
        self._updated = threading.Condition()

    def __call__(self, req: Request, c: Completion) -> None:
        with self._updated:
            self.updates.append(c)
            if c.finish_reason is not None:
                self.result = c
                self.done.set()
            self._updated.notify_all()

    def wait_tokens(self, n: int, timeout: float = 30.0) -> None:
        """Until an update carries at least ``n`` output tokens (a streamed request)."""
        with self._updated:
            got = self._updated.wait_for(lambda: self.updates and len(self.updates[-1].output_ids) >= n, timeout)
        assert got, f"no update with {n} tokens in {timeout} s"

    def wait(self, timeout: float = 60.0) -> Completion:
        assert self.done.wait(timeout), "request did not finish"
        return self.result  # type: ignore[return-value]


@pytest.fixture(scope="module")
def engine(engine_model):
    from agentrl.engine.model_runner import ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner(engine_model, device="cpu", dtype="float32", max_running_requests=16, max_context_tokens=512)
    sched = Scheduler(runner, weight_version="0", max_prefill_tokens=1024)
    sched.start()
    yield sched
    sched.stop()


@pytest.fixture(scope="module")
def teacher(engine_teacher):
    return engine_teacher


def submit(sched: Scheduler, prompt: list[int], rid: str = "", stream: bool = False, **params) -> Waiter:
    w = Waiter()
    inp = GenerateInput(rid or f"r{random.random()}", list(prompt), parse_sampling_params(params, VOCAB), True)
    sched.submit(Request(inp, w, stream=stream))
    return w


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 518) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def greedy_prompt(engine, max_new_tokens: int, ok) -> tuple[list[int], list[int]]:
    """The first seeded prompt whose greedy continuation satisfies ``ok(ids)`` (tests must not
    depend on what one random model happens to say for one prompt)."""
    for seed in range(100, 160):
        p = prompts(1, seed=seed)[0]
        ref = submit(engine, p, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True).wait().output_ids
        if ok(ref):
            return p, ref
    raise AssertionError("no prompt among 60 seeds gives a suitable greedy continuation")


def _has_new_token(ref: list[int], lo: int, hi: int) -> bool:
    return any(ref[i] not in ref[:i] for i in range(lo, min(hi, len(ref))))


def test_logprobs_match_teacher_forced_recompute_in_ragged_batches(engine, teacher):
    rng = random.Random(1)
    cases = []
    for i, p in enumerate(prompts(24, seed=1)):
        temperature = [0.0, 0.7, 1.0, 1.3][i % 4]
        cases.append(
            (
                p,
                temperature,
                submit(engine, p, max_new_tokens=rng.randint(1, 40), temperature=temperature, ignore_eos=True),
            )
        )
    worst = 0.0
    for p, temperature, w in cases:
        c = w.wait()
        assert c.finish_reason["type"] == "length"
        assert len(c.output_logprobs) == len(c.output_ids) == c.finish_reason["length"]
        worst = max(worst, max_abs_diff(c.output_logprobs, teacher.logprobs(p, c.output_ids, temperature)))
    assert worst <= 1e-4, worst


def test_next_turns_reuse_the_cached_prefix_and_match_the_teacher(engine, teacher):
    """Turns 2 and 3 send prompt + output + new tokens: the prefix comes from the cache, only the
    new tokens are prefilled, and the logprobs still match a full recompute."""
    from agentrl.engine.weights import EngineWeightReceiver

    cache = engine.runner.prefix_cache
    engine.call(cache.clear).result()  # no entries from other tests
    episodes = prompts(6, seed=11)
    temps = [0.0, 1.0, 0.7, 0.0, 1.3, 1.0]
    worst, hit_before, expected = 0.0, cache.hit_tokens, 0
    fed = [0] * len(episodes)  # what each episode's previous turn left in the cache
    for turn in range(3):
        waiters = [
            submit(engine, p, max_new_tokens=5 + i, temperature=temps[i], ignore_eos=True)
            for i, p in enumerate(episodes)
        ]
        nxt = []
        for i, (p, w) in enumerate(zip(episodes, waiters)):
            c = w.wait()
            worst = max(worst, max_abs_diff(c.output_logprobs, teacher.logprobs(p, c.output_ids, temps[i])))
            assert c.cached_tokens == fed[i]  # meta_info.cached_tokens
            fed[i] = len(p) + len(c.output_ids) - 1  # the next turn finds everything this one fed
            if turn < 2:
                expected += fed[i]
            nxt.append(p + c.output_ids + [7, 8, 9 + turn])  # a "tool result" appended
        episodes = nxt
    assert worst <= 1e-4, worst
    assert cache.hit_tokens - hit_before == expected
    # Receiving weights leaves the cache alone (the update request's flush_cache decides); a flush empties it.
    assert cache.tokens > 0
    engine.call(lambda: EngineWeightReceiver(engine.runner).apply({})).result()
    assert cache.tokens > 0
    assert engine.call(engine.flush_cache).result()
    assert cache.tokens == 0 and not cache.entries


def test_greedy_matches_argmax_and_top_k_1(engine, teacher):
    p = prompts(1, seed=3)[0]
    a = submit(engine, p, max_new_tokens=12, temperature=0.0, ignore_eos=True).wait()
    b = submit(engine, p, max_new_tokens=12, temperature=0.9, top_k=1, ignore_eos=True).wait()
    assert a.output_ids == teacher.greedy(p, 12) == b.output_ids


def test_stop_token_is_kept_with_its_logprob(engine, teacher):
    p, ref = greedy_prompt(engine, 30, lambda r: _has_new_token(r, 3, 29))
    stop_at = next(i for i in range(3, 29) if ref[i] not in ref[:i])  # a first occurrence before the last token
    c = submit(engine, p, max_new_tokens=30, temperature=0.0, stop_token_ids=[ref[stop_at]]).wait()
    assert c.output_ids == ref[: stop_at + 1]
    assert c.finish_reason == {"type": "stop", "matched": ref[stop_at]}
    assert max_abs_diff(c.output_logprobs, teacher.logprobs(p, c.output_ids)) <= 1e-4
    ignored = submit(
        engine, p, max_new_tokens=30, temperature=0.0, stop_token_ids=[ref[stop_at]], ignore_eos=True
    ).wait()
    assert ignored.finish_reason == {"type": "length", "length": 30}  # SGLang: ignore_eos skips all token stops


def test_the_last_allowed_token_finishes_by_length_even_when_it_is_a_stop(engine):
    p, ref = greedy_prompt(engine, 20, lambda r: r[-1] not in r[:-1])
    c = submit(engine, p, max_new_tokens=20, temperature=0.0, stop_token_ids=[ref[-1]]).wait()
    assert c.output_ids == ref and c.finish_reason == {"type": "length", "length": 20}  # length is checked first


def test_model_eos_ids_stop_generation(engine):
    p, ref = greedy_prompt(engine, 30, lambda r: _has_new_token(r, 2, 29))
    stop_at = next(i for i in range(2, 29) if ref[i] not in ref[:i])  # a first occurrence before the last token
    saved = engine.runner.eos_token_ids
    engine.runner.eos_token_ids = frozenset({ref[stop_at]})  # as if it were the model's EOS id
    try:
        c = submit(engine, p, max_new_tokens=30, temperature=0.0).wait()
        d = submit(engine, p, max_new_tokens=30, temperature=0.0, ignore_eos=True).wait()
    finally:
        engine.runner.eos_token_ids = saved
    assert c.output_ids == ref[: stop_at + 1] and c.finish_reason == {"type": "stop", "matched": ref[stop_at]}
    assert d.output_ids == ref


def test_stop_string_ends_generation(engine):
    tok = engine.tokenizer

    def has_stop(r: list[int]) -> bool:
        text = tok.decode(r)
        return any(text[i : i + 2].isalnum() for i in range(len(text) // 2, len(text) - 1))

    p, ref = greedy_prompt(engine, 30, has_stop)
    text = tok.decode(ref)
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].isalnum())
    c = submit(engine, p, max_new_tokens=30, temperature=0.0, stop=[stop]).wait()
    assert c.finish_reason == {"type": "stop", "matched": stop}
    assert stop in tok.decode(c.output_ids) and stop not in tok.decode(c.output_ids[:-1])
    assert c.output_ids == ref[: len(c.output_ids)]


def test_sampling_seed_is_deterministic_whatever_the_batch(engine):
    p = prompts(1, seed=6)[0]
    a = submit(engine, p, max_new_tokens=16, temperature=1.0, sampling_seed=42, ignore_eos=True)
    others = [submit(engine, q, max_new_tokens=8, ignore_eos=True) for q in prompts(5, seed=7)]
    a = a.wait()
    for o in others:
        o.wait()
    b = submit(engine, p, max_new_tokens=16, temperature=1.0, sampling_seed=42, ignore_eos=True).wait()
    c = submit(engine, p, max_new_tokens=16, temperature=1.0, sampling_seed=43, ignore_eos=True).wait()
    assert a.output_ids == b.output_ids != c.output_ids


def test_top_p_and_min_p_restrict_sampling(engine, teacher):
    p = prompts(1, seed=8)[0]
    greedy = teacher.greedy(p, 8)
    c = submit(engine, p, max_new_tokens=8, temperature=1.0, top_p=1e-6, ignore_eos=True).wait()
    assert c.output_ids == greedy  # only the top token survives top-p
    d = submit(engine, p, max_new_tokens=8, temperature=1.0, min_p=1.0, ignore_eos=True).wait()
    assert d.output_ids == greedy  # min_p = 1 keeps only tokens as likely as the top one
    # the returned logprobs are still those of the full temperature-scaled distribution
    assert max_abs_diff(c.output_logprobs, teacher.logprobs(p, c.output_ids)) <= 1e-4


def test_a_request_joins_and_leaves_the_running_batch(engine):
    long = submit(engine, [5, 6, 7], max_new_tokens=150, ignore_eos=True, rid="long", stream=True)
    long.wait_tokens(2)
    short = submit(engine, [8, 9], max_new_tokens=3, ignore_eos=True, rid="short")
    short.wait(30)
    assert not long.done.is_set(), "the short request had to wait for the long one"
    assert long.wait().finish_reason == {"type": "length", "length": 150}


def _call(engine, fn):
    return engine.call(fn).result(30)


def _turns(engine, n: int = 3) -> None:
    """Return once the scheduler has gone around its loop (past its "step or wait" decision) about ``n``
    times: each call runs in its thread between steps, and the next is only queued once it has run."""
    for _ in range(n):
        _call(engine, lambda: None)


def test_pause_abort_returns_partial_output_and_holds_new_requests(engine):
    w = submit(engine, [5, 6, 7], max_new_tokens=400, ignore_eos=True, stream=True)
    w.wait_tokens(3)
    assert _call(engine, lambda: engine.pause("abort")) == 1
    c = w.wait()
    assert c.finish_reason["type"] == "abort" and 3 <= len(c.output_ids) < 400
    assert len(c.output_logprobs) == len(c.output_ids)
    held = submit(engine, [5, 6], max_new_tokens=4)
    assert _call(engine, lambda: len(engine.waiting)) == 1  # the scheduler has taken it in ...
    _turns(engine)  # ... and left it waiting, turn after turn
    assert not held.done.is_set() and not held.updates, "a new request ran while paused"
    _call(engine, engine.resume)
    assert held.wait().finish_reason == {"type": "length", "length": 4}


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_retract_and_in_place_resume_where_they_stopped(engine, teacher, mode):
    p = [20, 21, 22, 23]
    w = submit(engine, p, max_new_tokens=60, temperature=0.8, ignore_eos=True, stream=True)
    w.wait_tokens(5)
    _call(engine, lambda: engine.pause(mode))
    n_paused = len(w.updates[-1].output_ids)
    _turns(engine)  # turns in which a step would have generated tokens
    assert len(w.updates[-1].output_ids) == n_paused and not w.done.is_set()
    if mode == "retract":
        assert not engine.running and engine.waiting  # back in the queue, KV dropped
    _call(engine, engine.resume)
    c = w.wait()
    assert c.finish_reason == {"type": "length", "length": 60}
    assert max_abs_diff(c.output_logprobs, teacher.logprobs(p, c.output_ids, 0.8)) <= 1e-4


def test_abort_by_rid_and_flush_cache(engine):
    w = submit(engine, [1, 2, 3], max_new_tokens=400, ignore_eos=True, rid="victim", stream=True)
    w.wait_tokens(2)
    assert _call(engine, engine.flush_cache) is False  # busy
    assert _call(engine, lambda: engine.abort("victim")) == 1
    assert w.wait().finish_reason["type"] == "abort"
    assert _call(engine, engine.flush_cache) is True
    assert submit(engine, [4, 5], max_new_tokens=3).wait().finish_reason["type"] == "length"


def test_abort_by_rid_takes_the_requests_it_prefixes_as_sglang_does(engine):
    _call(engine, lambda: setattr(engine, "updating", True))  # hold them in the queue
    ws = {rid: submit(engine, [6, 7], rid=rid, max_new_tokens=3) for rid in ("ep1", "ep1-0", "ep10", "ep2")}
    assert _call(engine, lambda: engine.abort("ep1-")) == 0  # no live request has exactly this rid
    assert _call(engine, lambda: engine.abort("ep1")) == 3
    _call(engine, lambda: setattr(engine, "updating", False))
    assert {rid: w.wait().finish_reason["type"] for rid, w in ws.items()} == {
        "ep1": "abort",
        "ep1-0": "abort",
        "ep10": "abort",
        "ep2": "length",
    }


def test_flush_cache_ignores_the_queue_only_of_a_paused_engine(engine):
    """SGLang's rule: waiting requests block a flush unless generation is paused (no K/V is held)."""
    _call(engine, lambda: setattr(engine, "updating", True))  # holds requests without pausing
    w = submit(engine, [6, 7], max_new_tokens=3, ignore_eos=True)
    assert _call(engine, engine.flush_cache) is False
    _call(engine, lambda: engine.pause("retract"))
    assert _call(engine, engine.flush_cache) is True and engine.waiting
    _call(engine, engine.resume)
    _call(engine, lambda: setattr(engine, "updating", False))
    assert w.wait().finish_reason == {"type": "length", "length": 3}


def test_a_request_the_scheduler_cannot_take_fails_alone_and_the_thread_serves_on(engine):
    """Found by tests/test_fuzz_engine.py: a sampling_seed beyond 64 bits raised in the scheduler thread
    (outside any try) and stopped the engine for good. The API refuses it now; should validation ever
    let such a request through, it fails alone."""
    w = Waiter()
    params = dataclasses.replace(parse_sampling_params({"max_new_tokens": 3}, VOCAB), sampling_seed=2**70)
    engine.submit(Request(GenerateInput("bad-seed", [1, 2], params, True), w))
    c = w.wait()
    assert c.finish_reason["type"] == "abort" and "internal engine error" in c.finish_reason["message"]
    assert engine.alive and submit(engine, [4, 5], max_new_tokens=3).wait().finish_reason["type"] == "length"


def test_weight_version_spans_follow_updates(engine):
    w = submit(engine, [30, 31], max_new_tokens=40, ignore_eos=True, stream=True)
    w.wait_tokens(3)
    _call(engine, lambda: engine.pause("in_place"))
    _call(engine, lambda: setattr(engine, "weight_version", "7"))
    _call(engine, engine.resume)
    c = w.wait()
    _call(engine, lambda: setattr(engine, "weight_version", "0"))
    assert c.weight_version == "7"
    assert [s["version"] for s in c.weight_versions] == ["0", "7"]
    assert c.weight_versions[0]["start"] == 0 and c.weight_versions[-1]["end"] == 40
    assert c.weight_versions[0]["end"] == c.weight_versions[1]["start"]


def test_bfloat16_runner_samples_with_fp32_logprobs(engine_model, teacher):
    """The GPU dtype path (bf16 weights, fp32 softmax), exercised on CPU."""
    from agentrl.engine.model_runner import ModelRunner

    runner = ModelRunner(engine_model, device="cpu", dtype="bfloat16", max_running_requests=4, max_context_tokens=128)
    sched = Scheduler(runner)
    sched.start()
    try:
        p = prompts(1, seed=11)[0]
        c = submit(sched, p, max_new_tokens=6, temperature=0.8, ignore_eos=True).wait()
    finally:
        sched.stop()
    assert runner.model.dtype == torch.bfloat16 and len(c.output_ids) == 6
    assert all(isinstance(x, float) for x in c.output_logprobs)
    assert max_abs_diff(c.output_logprobs, teacher.logprobs(p, c.output_ids, 0.8)) < 0.1
