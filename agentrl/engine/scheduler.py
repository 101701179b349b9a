"""Continuous-batching scheduler of the embedded engine (one worker thread).

Each iteration takes new requests from the inbox (any thread may ``submit``), runs control
operations (pause, abort, weight updates), then, unless paused or inside a weight update, prefills
as many waiting requests as fit and runs one decode step for every running request.

Invariants: control operations run in this thread between forward steps, so the model never
changes under a running forward; finishing follows SGLang's order (length, token stops, stop
strings) and the stop token stays in the output; pause modes are SGLang's (``abort``, ``retract``,
``in_place``); every request records which ``weight_version`` produced each of its tokens
(``weight_versions`` spans). A request with images carries them prepared (``GenerateInput.vision``),
its prefix-cache key marks them, and its decode positions carry its mRoPE delta. See docs/engine.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.engine.model_runner import ModelRunner
from agentrl.engine.native_api import (
    Completion,
    GenerateInput,
    finish_abort,
    finish_length,
    finish_stop_str,
    finish_stop_token,
)

log = logging.getLogger(__name__)

Sink = Callable[["Request", Completion], None]


@dataclass(eq=False)
class Request:
    inp: GenerateInput
    sink: Sink  # called from the scheduler thread: with each streamed update, and when finished
    stream: bool = False
    created: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    kv_len: int = 0  # tokens whose K/V are in the cache
    pending: int | None = None  # last sampled token, not yet fed to the model
    generator: torch.Generator | None = None
    versions: list[dict] = field(default_factory=list)
    stop_window: int = 0  # tokens to decode when checking stop strings
    last_streamed: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first prefill

    @property
    def rid(self) -> str:
        return self.inp.rid

    @property
    def max_new_tokens(self) -> int:
        return self.inp.params.max_new_tokens  # type: ignore[return-value]

    @property
    def rope_delta(self) -> int:
        return self.inp.vision.delta if self.inp.vision is not None else 0

    def cache_key(self) -> list[int]:
        """The prefix-cache key of what this request feeds: its tokens, images marked by their digests."""
        prompt = list(self.inp.vision.key) if self.inp.vision is not None else self.inp.input_ids
        return prompt + self.output_ids


class Scheduler:
    """Runs requests on a :class:`ModelRunner` in a background thread."""

    def __init__(self, runner: ModelRunner, *, weight_version: str = "default", max_prefill_tokens: int = 8192):
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.weight_version = weight_version
        self.max_prefill_tokens = max(max_prefill_tokens, runner.max_context_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # row i <-> KV slot i
        self.paused = False
        self.updating = False  # inside begin_weight_update .. end_weight_update
        self.num_steps = 0
        self.num_generated = 0
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._ops: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self.error: str | None = None

    # -- thread-safe API ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, req: Request) -> None:
        self._inbox.put(req)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` in the scheduler thread between forward steps; returns a future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(RuntimeError("the engine scheduler is not running"))
            return fut
        self._ops.put((fn, fut))
        self._wake.set()
        return fut

    def load(self) -> dict[str, int]:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting) + self._inbox.qsize()}

    # -- control operations (run in the scheduler thread via call()) -------------------------
    def pause(self, mode: str) -> int:
        """Returns how many requests were affected."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode must be one of abort, retract, in_place; got {mode!r}")
        self.paused = True
        if mode == "abort":
            return self.abort(None, "aborted by /pause_generation")
        if mode == "retract":
            n = len(self.running)
            for req in reversed(self.running):
                req.kv_len = 0  # re-prefilled from prompt + output on continue
                self.waiting.appendleft(req)
            self.running = []
            return n
        return len(self.running)

    def resume(self) -> None:
        self.paused = False

    def abort(self, rid: str | None, message: str = "aborted by /abort_request") -> int:
        """Finish the request(s) of ``rid`` (all when None) with their partial output. As in SGLang,
        when a request ``rid`` is live, every request whose rid starts with it goes too."""
        self._drain_inbox()
        live = list(self.running) + list(self.waiting)
        if rid is not None and not any(r.rid == rid for r in live):
            return 0
        victims = [r for r in live if rid is None or r.rid.startswith(rid)]
        for req in victims:
            self._finish(req, finish_abort(message))
        self._remove_finished()
        return len(victims)

    def flush_cache(self) -> bool:
        """Drop the prefix cache and the K/V buffers. SGLang's rule: refused while requests run, or
        wait in an engine that is not paused (a paused engine's queue holds no K/V)."""
        self._drain_inbox()
        if self.running or (self.waiting and not self.paused):
            return False
        self.runner.cache.release()
        self.runner.prefix_cache.clear()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        # Everything the engine does (forward, KV moves, weight copies) is inference: one mode for the thread.
        with torch.inference_mode():
            self._serve()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_inbox()
            self._run_ops()
            if self.paused or self.updating or not (self.waiting or self.running):
                self._wake.wait(0.5)
                continue
            try:
                self._step()
            except Exception as e:  # keep serving: fail what was running, log, continue
                log.error("engine step failed:\n%s", traceback.format_exc())
                self.error = f"{type(e).__name__}: {e}"
                for req in self.running:
                    self._finish(req, finish_abort(f"internal engine error: {self.error}"))
                self.running = []
        # Shutting down: nobody will serve what is left.
        self._drain_inbox()
        for req in list(self.running) + list(self.waiting):
            self._finish(req, finish_abort("engine shutting down"))
        self.running, self.waiting = [], deque()
        while not self._ops.empty():
            _, fut = self._ops.get()
            fut.set_exception(RuntimeError("engine shutting down"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                req = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._prepare(req)
            except Exception as e:  # validation let something through: fail this request, not the thread
                log.error("engine could not take request %s:\n%s", req.rid, traceback.format_exc())
                self._finish(req, finish_abort(f"internal engine error: {type(e).__name__}: {e}"))
                continue
            self.waiting.append(req)

    def _prepare(self, req: Request) -> None:
        if req.inp.images and req.inp.vision is None:  # the server prepares them off this thread
            req.inp.vision = self.runner.prepare_images(req.inp.input_ids, req.inp.images)
        p = req.inp.params
        if p.sampling_seed is not None:
            req.generator = torch.Generator(device=self.runner.device)
            req.generator.manual_seed(p.sampling_seed)
        if p.stop:
            req.stop_window = (
                max(
                    max(len(s) for s in p.stop),
                    max(len(self.tokenizer.encode(s, add_special_tokens=False)) for s in p.stop),
                )
                + 1
            )
        if p.max_new_tokens is None:
            req.inp.params = dataclasses.replace(
                p, max_new_tokens=self.runner.max_context_tokens - len(req.inp.input_ids) - 1
            )

    def _run_ops(self) -> None:
        while True:
            try:
                fn, fut = self._ops.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported to the caller (HTTP handler)
                fut.set_exception(e)

    def _step(self) -> None:
        if self.waiting and len(self.running) < self.runner.max_running_requests:
            self._prefill()
        if self.running:
            self._decode()
        self.num_steps += 1

    def _admit(self) -> list[Request]:
        """Pop waiting requests (FIFO) that fit in the free slots and the prefill budget."""
        batch: list[Request] = []
        width = 0
        free = self.runner.max_running_requests - len(self.running)
        while self.waiting and len(batch) < free:
            req = self.waiting[0]
            n = len(req.inp.input_ids) + len(req.output_ids)
            new_width = max(width, n)
            if batch and new_width * (len(batch) + 1) > self.max_prefill_tokens:
                break
            batch.append(self.waiting.popleft())
            width = new_width
        return batch

    def _prefill(self) -> None:
        batch = self._admit()
        if not batch:
            return
        zero = [r for r in batch if r.max_new_tokens == 0 and not r.output_ids]
        for req in zero:  # nothing to generate: SGLang answers with an empty output
            self._finish(req, finish_length(0))
        batch = [r for r in batch if r.finish_reason is None]
        if not batch:
            return
        row0 = len(self.running)
        self.running.extend(batch)  # before the forward: if it fails, the error path finishes them
        seqs = [r.inp.input_ids + r.output_ids for r in batch]
        starts = [self.runner.load_prefix(row0 + i, r.cache_key()) for i, r in enumerate(batch)]
        logits = self.runner.prefill(row0, seqs, starts, [r.inp.vision for r in batch])
        for req, seq, start in zip(batch, seqs, starts):
            if not req.output_ids:  # a retracted request's re-prefill does not count again
                req.cached_tokens = start
            req.kv_len = len(seq)
            req.pending = None
        self._sample_and_check(batch, logits)

    def _decode(self) -> None:
        rows = self.running
        logits = self.runner.decode(
            [r.pending for r in rows],  # type: ignore[misc]
            [r.kv_len for r in rows],
            [r.rope_delta for r in rows],
        )
        for req in rows:
            req.kv_len += 1
        self._sample_and_check(rows, logits)

    def _sample_and_check(self, rows: list[Request], logits: torch.Tensor) -> None:
        rp = self.runner.row_params([r.inp.params for r in rows], [r.generator for r in rows])
        tokens, logprobs = self.runner.sample(logits, rp)
        version = self.weight_version
        for req, tok, lp in zip(rows, tokens, logprobs):
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            req.pending = tok
            n = len(req.output_ids)
            if req.versions and req.versions[-1]["version"] == version:
                req.versions[-1]["end"] = n
            else:
                req.versions.append({"version": version, "start": n - 1, "end": n})
            reason = self._check_finished(req, tok)
            if reason is not None:
                self._finish(req, reason)
            elif req.stream and n - req.last_streamed >= (req.inp.params.stream_interval or 1):
                req.last_streamed = n
                req.sink(req, self._completion(req, copy=True))
        self.num_generated += len(rows)
        self._remove_finished()

    def _check_finished(self, req: Request, tok: int) -> dict | None:
        p = req.inp.params
        if len(req.output_ids) >= p.max_new_tokens:  # type: ignore[operator]
            return finish_length(p.max_new_tokens)  # type: ignore[arg-type]
        if not p.ignore_eos and (tok in p.stop_token_ids or tok in self.runner.eos_token_ids):
            return finish_stop_token(tok)
        if p.stop:
            tail = self.tokenizer.decode(req.output_ids[-req.stop_window :])
            for s in p.stop:
                if s in tail:
                    return finish_stop_str(s)
        return None

    def _finish(self, req: Request, reason: dict) -> None:
        if req.finish_reason is not None:
            return
        req.finish_reason = reason
        try:
            req.sink(req, self._completion(req))
        except Exception:  # a broken sink must not take the scheduler down
            log.exception("request sink failed for %s", req.rid)

    def _remove_finished(self) -> None:
        """Drop finished requests from the queue and compact the running rows (and their KV slots)."""
        if any(r.finish_reason is not None for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r.finish_reason is None)
        rows = self.running
        i = 0
        while i < len(rows):
            if rows[i].finish_reason is None:
                i += 1
                continue
            done = rows[i]
            if done.kv_len:  # its K/V serves the episode's next turn (prefix cache)
                self.runner.save_prefix(i, done.cache_key()[: done.kv_len])
            last = len(rows) - 1
            if i != last:
                self.runner.cache.move(last, i, rows[last].kv_len)
                rows[i] = rows[last]
            rows.pop()

    def _completion(self, req: Request, copy: bool = False) -> Completion:
        ids, lps = (list(req.output_ids), list(req.output_logprobs)) if copy else (req.output_ids, req.output_logprobs)
        return Completion(
            rid=req.rid,
            prompt_tokens=len(req.inp.input_ids),
            output_ids=ids,
            output_logprobs=lps,
            finish_reason=req.finish_reason,
            weight_version=self.weight_version,
            weight_versions=[dict(v) for v in req.versions],
            e2e_latency=time.perf_counter() - req.created,
            cached_tokens=req.cached_tokens,
        )
