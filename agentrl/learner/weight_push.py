"""The weight push, learner side: from FSDP2 shards to the engines' parameters.

The learner reaches the engines over SGLang's HTTP API and the broadcast group
(``agentrl.weight_group``) only; the engine's end is ``agentrl.engine.weights``. What is sent: the
parameters under Hugging Face names in the engines' dtype, minus a tied ``lm_head``
(:func:`without_tied_head`), with LoRA adapters merged in. :func:`plan_buckets` groups them from
metadata alone; a bucket is one gather over the shards (every rank), one HTTP
``/update_weights_from_distributed`` per engine and its broadcasts, so rank 0 holds one bucket.

An update (:meth:`WeightUpdater.push_plan`): pause every engine -> version ``"default"`` and
``/begin_weight_update`` at once, the first bucket gathered meanwhile -> per bucket, the HTTP call
fired at every engine without waiting, the broadcasts, the answers (a ``flattened_bucket``: the
next bucket gathered and packed into a buffer kept across pushes while the engines apply) ->
``/end_weight_update`` -> continue. End and continue run even when a bucket fails. The last bucket
carries ``weight_version`` and ``flush_cache`` (K/V from old weights must not serve a later turn).
Timings and failures are read after a device synchronisation (NCCL's ``wait()`` does not block).

Invariants: an engine reports a policy's number only after a complete update, so the one rule is
that an engine not reporting the learner's version gets the weights (:meth:`WeightUpdater.lagging`);
a torch.distributed group cannot re-admit a rank, so any change of the answering engines forms a
new group (:meth:`WeightUpdater.membership_change`), and a push that loses a member raises
:class:`EngineLost`. Admin routes carry the admin key, keys are never logged.

``learner.lora.sync = "adapter"`` sends the adapter alone as a PEFT folder (:func:`push_adapter`:
pause with ``abort``, unload, load, version, continue). See docs/learner.md.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.config import LORA_ADAPTER_NAME
from agentrl.secrets import bearer
from agentrl.weight_group import bind_store_socket, destroy_weight_group, dtype_name, init_weight_group

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

T = TypeVar("T")
Bucket = list  # list[tuple[str, tensor]]: names and tensors (parameters, DTensors or full tensors)
PAUSE_MODES = ("abort", "retract", "in_place")
ENGINES_PER_HTTP_CLIENT = 16  # engines whose control calls share one httpx.Client (WeightUpdater.__init__)
ENGINE_WAIT_POLL_S = 0.1  # probes of engines that do not answer yet (wait_until_answering)
UNSET_VERSION = "default"  # SGLang's weight_version before anybody set one: no policy (actors wait on it)


# ----------------------------------------------------------------------- what is sent, in buckets


def without_tied_head(named: Iterable[tuple[str, T]], tied: bool = False) -> list[tuple[str, T]]:
    """The one tied-embedding rule: ``lm_head.weight`` is not sent when the embeddings are tied
    (``tied``, the model's ``tie_word_embeddings``) or when it is the same tensor as one already
    listed under another name (the same object, or for a plain tensor the same memory, as in a
    ``state_dict()``); engines tie it themselves, as SGLang does."""
    out: list[tuple[str, T]] = []
    seen: set[tuple] = set()
    for name, t in named:
        keys = _identity(t)
        if name == "lm_head.weight" and (tied or keys & seen):
            continue
        seen |= keys
        out.append((name, t))
    return out


def _identity(t: Any) -> set[tuple]:
    import torch
    from torch.distributed.tensor import DTensor

    keys: set[tuple] = {("object", id(t))}
    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):  # a DTensor's memory is its local shard
        keys.add(("memory", t.data_ptr(), tuple(t.shape), t.dtype))
    return keys


def tensors_to_push(model: nn.Module) -> list[tuple[str, Any]]:
    """The model's parameters to send, in a fixed order (the same on every learner rank); with
    LoRA adapters the base model's, adapted weights as ``MergedWeight`` s (merged when gathered)."""
    from agentrl.learner.lora import has_adapters, push_items

    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    named = push_items(model) if has_adapters(model) else model.named_parameters()
    return without_tied_head(named, tied)


def plan_buckets(
    named: Sequence[tuple[str, T]], bucket_bytes: int, dtype: torch.dtype | None = None
) -> list[list[tuple[str, T]]]:
    """The one bucketing pass: consecutive tensors up to ``bucket_bytes`` per bucket, counted in
    the dtype they are sent in (``dtype``, else their own); a bucket holds one dtype (so that a
    flattened bucket's views start at multiples of the item size). Metadata only: a DTensor's
    ``numel()`` is its global size, nothing is gathered."""
    buckets: list[list[tuple[str, T]]] = []
    bucket: list[tuple[str, T]] = []
    size, bucket_dtype = 0, None
    for name, t in named:
        send_dtype = dtype or t.dtype  # type: ignore[attr-defined]
        nbytes = t.numel() * send_dtype.itemsize  # type: ignore[attr-defined]
        if bucket and (size + nbytes > bucket_bytes or send_dtype != bucket_dtype):
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
        bucket_dtype = send_dtype
    if bucket:
        buckets.append(bucket)
    return buckets


def full_tensors(
    bucket: Sequence[tuple[str, Any]], dtype: torch.dtype | None = None, device: torch.device | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The bucket's full tensors: DTensor shards are all-gathered (a collective: every learner
    rank must call this for the same bucket), LoRA-adapted weights merged, then cast to ``dtype``
    and moved to ``device``."""
    import torch
    from torch.distributed.tensor import DTensor

    from agentrl.learner.lora import MergedWeight

    out = []
    with torch.no_grad():
        for name, t in bucket:
            data = t.data if isinstance(t, torch.nn.Parameter) else t
            if isinstance(data, MergedWeight):
                data = data.merged()
            elif isinstance(data, DTensor):
                data = data.full_tensor()
            data = data.detach()
            if dtype is not None and data.dtype != dtype:
                data = data.to(dtype)
            if device is not None and data.device != device:
                data = data.to(device)
            out.append((name, data.contiguous()))
    return out


def push_weights(
    model: nn.Module, updater: WeightUpdater | None, version: int, *, bucket_bytes: int, dtype: torch.dtype | None
) -> dict:
    """Push the model's weights to the engines: call on every learner rank (they take part in
    the gathers); rank 0 sends through ``updater``. Returns rank 0's timings (``{}`` elsewhere)."""
    import torch.distributed as dist

    plan = plan_buckets(tensors_to_push(model), bucket_bytes, dtype)
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    if is_main and updater is not None:
        return updater.push_plan(plan, version, lambda b: full_tensors(b, dtype, updater.device))
    for bucket in plan:
        full_tensors(bucket, dtype)
    return {}


def push_adapter(
    model: nn.Module,
    updater: WeightUpdater | None,
    version: int,
    *,
    folder_root: str | Path,
    spec: Any,
    base_model_path: str,
    keep: int = 2,
) -> dict:
    """LoRA, adapter only: call on every learner rank (they take part in the gathers); rank 0 writes
    ``folder_root/v<version>`` as a PEFT folder and loads it into the engines through ``updater``."""
    import shutil

    import torch.distributed as dist

    from agentrl.learner.lora import adapter_parameters, write_adapter

    tensors = dict(full_tensors(adapter_parameters(model)))  # small: the factors only
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    if not is_main or updater is None:
        return {}
    t0 = time.perf_counter()
    root = Path(folder_root)
    folder = write_adapter(root / f"v{version:08d}", tensors, spec, base_model_path)
    write_s = time.perf_counter() - t0
    stats = updater.push_adapter(folder, version)
    for old in sorted(p for p in root.glob("v*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return {
        **stats,
        "write_s": write_s,
        "total_s": time.perf_counter() - t0,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    }


def _settle(device: torch.device | str) -> bool:
    """Block the host until the work queued on ``device`` has run; True when it had to (CUDA).

    On NCCL, a broadcast's ``work.wait()`` only makes the current CUDA stream wait for it: the host
    goes on at once, so a time taken or an engine's answer read as success right after it would
    come before the bytes left. Gloo (CPU tensors) completes in ``wait()``: nothing to do."""
    import torch

    if torch.device(device).type != "cuda":
        return False
    torch.cuda.synchronize(device)
    return True


# ----------------------------------------------------------------------------- the updater


class WeightUpdateError(RuntimeError):
    """An engine refused or failed a weight update; the message names the engine."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status, when there was an answer


class EngineLost(WeightUpdateError):
    """An engine did not answer, or the broadcast to it broke: the group must be re-formed
    (:meth:`WeightUpdater.connect`) without it. A refusal (an answer) is a plain
    :class:`WeightUpdateError`."""


def rank_layout(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Rank offsets of the engines (1 + the TP ranks before each) and the group's world size."""
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += tp
    return offsets, next_rank


class WeightUpdater:
    """Trainer (rank 0) end of the weight-update protocol. Synchronous; not thread-safe."""

    # What is read from SGLang's answers (tests/test_engine_conformance.py: SGLang writes each there):
    # any control answer's refusal (`success` false) and its reason (`message`; LoRA routes: `error_message`;
    # errors: `error.message`), and /server_info's parallel sizes (engine_layout).
    ANSWER_FIELDS_READ = ("success", "message", "error_message", "error")
    SERVER_INFO_FIELDS_READ = ("tp_size", "dp_size")

    def __init__(
        self,
        engine_urls: list[str],
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        backend: str = "gloo",
        group_name: str = "agentrl_weights",
        bucket_bytes: int = 64 << 20,
        pause_mode: str = "abort",
        timeout_s: float = 600.0,
        load_format: str | None = None,
        api_key: str = "",
        admin_api_key: str = "",
        key_hint: str = "pass api_key / admin_api_key",
        probe_timeout_s: float = 5.0,
    ):
        import httpx

        if not engine_urls:
            raise ValueError("WeightUpdater needs at least one engine URL")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be abort, retract or in_place; got {pause_mode!r}")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(
                f"load_format must be None (one broadcast per tensor) or 'flattened_bucket'; got {load_format!r}"
            )
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.group_name, self.bucket_bytes = backend, group_name, bucket_bytes
        self.pause_mode, self.timeout_s, self.load_format = pause_mode, timeout_s, load_format
        # in_place keeps running requests (and their K/V) across the update: SGLang cannot flush then
        self.flush_cache = pause_mode != "in_place"
        if not self.flush_cache:
            log.warning(
                "pause_mode in_place: running requests keep K/V computed under the old weights, and the "
                "engines' prefix caches are not flushed (SGLang refuses to flush while requests run)"
            )
        self._api_headers = bearer(api_key)
        self._admin_headers = bearer(admin_api_key or api_key)
        self._key_hint = key_hint
        self.group = None
        self.group_id = ""  # the current group's name: group_name + a suffix new at every formation
        self.members: list[str] = []  # the engines in the group, in rank order (those that answered)
        self.labels: dict[str, str] = {}  # the weight_version each member reports, as this updater left it
        self.probe_timeout_s = probe_timeout_s
        self.group_port = 0  # where the current group's store listens
        self.rank_offsets: list[int] = []
        self.world_size = 0
        self._no_begin_end: set[str] = set()  # engines that answered 404 (SGLang before 0.5.23)
        self._adapter_loaded: set[str] = set()  # engines this updater has loaded the LoRA adapter into
        self._staging: torch.Tensor | None = None  # flattened buckets on the CPU (_pack)
        # one client per ENGINES_PER_HTTP_CLIENT engines, each keeping a connection alive to every one of
        # them: one client for all kept 20 (httpx's default) and its CPU per request grows with its connections
        self._https = [
            httpx.Client(
                timeout=httpx.Timeout(timeout_s, connect=10.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=2 * ENGINES_PER_HTTP_CLIENT),
            )
            for _ in range(0, len(self.engine_urls), ENGINES_PER_HTTP_CLIENT)
        ]
        self._http_of = {u: self._https[i // ENGINES_PER_HTTP_CLIENT] for i, u in enumerate(self.engine_urls)}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(4, 2 * len(self.engine_urls)), thread_name_prefix="weight-http"
        )

    @classmethod
    def from_config(cls, engine: Any, urls: list[str] | None = None, **kwargs: Any) -> WeightUpdater:
        """From an ``[engine]`` section: backend ``auto`` is nccl when this process sees a GPU, else
        gloo; keys from the variables ``engine.api_key_env`` / ``engine.admin_api_key_env`` name."""
        import torch

        from agentrl.secrets import read_secret

        backend = engine.weight_group_backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        hint = (
            f"set {engine.admin_api_key_env} (engine.admin_api_key_env) to the engines' --admin-api-key, "
            f"or {engine.api_key_env} (engine.api_key_env) to their --api-key"
        )
        return cls(
            list(urls if urls is not None else engine.urls),
            backend=backend,
            bucket_bytes=int(engine.weight_bucket_mb * 2**20),
            api_key=read_secret(engine.api_key_env),
            admin_api_key=read_secret(engine.admin_api_key_env),
            key_hint=hint,
            **kwargs,
        )

    @property
    def device(self) -> torch.device:
        """Where broadcast tensors must live: the current GPU for nccl, else the CPU."""
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    # -- HTTP ---------------------------------------------------------------------------------
    def _request(
        self,
        method: str,
        url: str,
        path: str,
        body: dict | None = None,
        *,
        admin: bool = True,
        missing_ok: bool = False,
        timeout_s: float | None = None,
    ) -> dict | None:
        """One call; a refusal raises :class:`WeightUpdateError` naming the engine (None: a 404
        with ``missing_ok``)."""
        import httpx

        headers = self._admin_headers if admin else self._api_headers
        try:
            resp = self._http_of.get(url, self._https[0]).request(
                method,
                f"{url}{path}",
                json=body if method == "POST" else None,
                headers=headers,
                timeout=httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s,
            )
        except httpx.HTTPError as e:
            raise EngineLost(f"{url}{path}: {type(e).__name__}: {e}") from None
        if resp.status_code == 404 and missing_ok:
            return None
        try:
            data = resp.json()
        except ValueError:
            data = {"message": resp.text.strip()}
        if not isinstance(data, dict):
            data = {"message": str(data)}
        if resp.status_code in (401, 403):
            raise WeightUpdateError(
                f"{url}{path} answered {resp.status_code}: the engine wants an API key ({self._key_hint})",
                resp.status_code,
            )
        if resp.status_code != 200 or data.get("success") is False:
            err = data.get("error")
            msg = (
                data.get("message")
                or data.get("error_message")
                or (  # error_message: LoRA routes
                    err.get("message") if isinstance(err, dict) else err
                )
                or resp.text
            )
            raise WeightUpdateError(f"{url}{path} answered {resp.status_code}: {msg}", resp.status_code)
        return data

    def _post(self, url: str, path: str, body: dict | None = None) -> dict:
        return self._request("POST", url, path, body or {})  # type: ignore[return-value]

    def _get(self, url: str, paths: tuple[str, ...], timeout_s: float | None = None) -> dict:
        """GET the first of ``paths`` the engine has (newer name first), with the api key."""
        for path in paths:
            data = self._request("GET", url, path, admin=False, missing_ok=path != paths[-1], timeout_s=timeout_s)
            if data is not None:
                return data
        raise AssertionError("unreachable")

    def _fire(
        self, urls: list[str], path: str, body_for: Callable[[int], dict | None]
    ) -> list[concurrent.futures.Future]:
        """POST to the engines concurrently; ``body_for(i)`` gives the i-th engine's body."""
        return [self._pool.submit(self._post, url, path, body_for(i)) for i, url in enumerate(urls)]

    @staticmethod
    def _collect(futures: list[concurrent.futures.Future]) -> list[dict]:
        """Every answer, or one error naming every failure: :class:`EngineLost` when an engine
        among them did not answer (the other failures are then usually its consequence)."""
        errors: list[Exception] = []
        results = []
        for f in futures:
            try:
                results.append(f.result())
            except Exception as e:
                errors.append(e)
        if errors:
            kind = EngineLost if any(isinstance(e, EngineLost) for e in errors) else WeightUpdateError
            raise kind("; ".join(str(e) for e in errors))
        return results

    def _all(self, path: str, body: dict | None = None, urls: list[str] | None = None) -> list[dict]:
        """POST to every member (or ``urls``) concurrently; every answer or one error."""
        return self._collect(self._fire(self.members if urls is None else urls, path, lambda i: body))

    def _session(self, path: str) -> None:
        """Begin or end the update session on every member (:meth:`_session_calls`); one error or none."""
        self._collect(self._session_calls(path))

    def _session_calls(self, path: str) -> list[concurrent.futures.Future]:
        """``/begin_weight_update`` or ``/end_weight_update`` where the engine has it (SGLang 0.5.23
        requires them around an update; older builds answer 404: skipped, warned once per engine).

        SGLang's auth treats a path it has no route for as a NORMAL route, so with both keys set
        an older build refuses the admin key there (401) before it can answer 404: a refusal is
        asked again with the api key, and a 404 then means "no such route".

        A begin refused because a session is open (a learner killed mid-push left it; nothing
        else opens one) ends that session and begins again, once."""

        def call(url: str) -> None:
            try:
                missing = self._request("POST", url, path, {}, missing_ok=True) is None
            except WeightUpdateError as refused:
                if (
                    path == "/begin_weight_update"
                    and refused.status not in (401, 403)
                    and not isinstance(refused, EngineLost)
                ):
                    log.warning(
                        "%s refused to begin an update (%s): ending the session left open, beginning again",
                        url,
                        refused,
                    )
                    self._request("POST", url, "/end_weight_update", {})
                    self._request("POST", url, path, {})
                    return
                if refused.status not in (401, 403) or self._admin_headers == self._api_headers:
                    raise
                try:
                    missing = self._request("POST", url, path, {}, admin=False, missing_ok=True) is None
                except WeightUpdateError:
                    raise refused from None
                if not missing:
                    raise refused from None
            if missing:
                self._no_begin_end.add(url)
                log.warning("%s has no %s (SGLang before 0.5.23?): updating without a begin/end session", url, path)

        urls = [u for u in self.members if u not in self._no_begin_end]
        return [self._pool.submit(call, u) for u in urls]

    # -- membership: the group, who is in it, what each member reports ----------------------
    def probe(self) -> dict[str, str | None]:
        """The ``weight_version`` every configured engine reports (``/model_info``), ``None`` for an
        engine that does not answer (a connection error, a timeout, a 5xx) within
        ``probe_timeout_s``. A refusal (401/403) raises: that is a key to fix, not a dead engine."""

        def one(url: str) -> str | None:
            try:
                info = self._get(url, ("/model_info", "/get_model_info"), timeout_s=self.probe_timeout_s)
            except EngineLost:
                return None
            except WeightUpdateError as e:
                if e.status is not None and e.status >= 500:
                    return None
                raise
            return str(info.get("weight_version"))

        futures = {url: self._pool.submit(one, url) for url in self.engine_urls}
        return {url: f.result() for url, f in futures.items()}

    def wait_until_answering(self, timeout_s: float) -> None:
        """Until every configured engine answers a probe, for at most ``timeout_s`` (engines that are
        still loading: a group formed at once would leave them out until the first engine check)."""
        if timeout_s <= 0:
            return
        deadline = time.monotonic() + timeout_s
        silent = [u for u, v in self.probe().items() if v is None]
        if silent:
            log.info("waiting up to %.0f s for %s to answer", timeout_s, ", ".join(silent))
        while silent and time.monotonic() < deadline:
            time.sleep(ENGINE_WAIT_POLL_S)
            silent = [u for u, v in self.probe().items() if v is None]

    def membership_change(self, version: int) -> str:
        """Why the group must be re-formed before the next push, or ``""``: an engine answers that
        is not in the group (started, or back after a restart), a member does not answer, a
        member reports a version this updater did not leave on it (it was restarted, by agentrl's
        supervisor or anything else, e.g. Kubernetes), or there is no group (a push failed)."""
        reported = self.probe()
        answering = [u for u in self.engine_urls if reported[u] is not None]
        reasons = [f"{u} does not answer" for u in self.members if reported[u] is None]
        reasons += [f"{u} answers and is not in the group" for u in answering if u not in self.members]
        reasons += [
            f"{u} reports weight_version {reported[u]!r}, not {self.labels.get(u)!r} (restarted?)"
            for u in self.members
            if reported[u] is not None and reported[u] != self.labels.get(u)
        ]
        if not reasons and self.group is None and answering:
            reasons.append("no weight group (the last push or formation failed)")
        return "; ".join(reasons)

    def lagging(self, version: int) -> list[str]:
        """Members that do not report ``version``: they need the learner's weights."""
        return [u for u in self.members if self.labels.get(u) != str(version)]

    def engine_layout(self, urls: list[str] | None = None) -> list[int]:
        """Each engine's ``tp_size`` from ``/server_info`` (``/get_server_info`` on older builds);
        refuses an engine with ``dp_size`` > 1."""
        tp_sizes = []
        for url in self.engine_urls if urls is None else urls:
            info = self._get(url, ("/server_info", "/get_server_info"))
            tp, dp = int(info.get("tp_size", 1)), int(info.get("dp_size", 1))
            if dp > 1:
                raise WeightUpdateError(
                    f"{url} runs dp_size={dp}: SGLang cannot take distributed weight updates with data-parallel "
                    "replicas (init_weights_update_group asserts dp_size == 1). Run each replica as its own engine "
                    "(behind sglang-router, engine.router_url) and list every one in engine.urls."
                )
            if tp < 1:
                raise WeightUpdateError(f"{url} reports tp_size={tp}")
            tp_sizes.append(tp)
        return tp_sizes

    def connect(self) -> None:
        """(Re-)form the group with every engine that answers: the trainer is rank 0, engine i's
        TP ranks follow the engines before it. A torch.distributed group cannot re-admit a rank,
        so any change of membership is a new group, under a new name (``group_name`` + a suffix:
        SGLang refuses a second group of a name it holds, and a group a killed learner left on an
        engine cannot be destroyed by name from a new process). This end is destroyed first, the
        previous group on the engines that were in it and still answer, generation is continued
        (a learner killed mid-push leaves its engines paused; a session it left open is ended by
        the next begin, see :meth:`_session`), then the new group is created. An engine that does
        not answer is left out (:meth:`membership_change` notices when it is back); with none
        answering there is no group and pushes reach nobody."""
        self._drop_group()
        reported = self.probe()
        left_out = [u for u in self.engine_urls if reported[u] is None]
        if left_out:
            log.warning("weight group without %s: not answering (it joins when it answers again)", ", ".join(left_out))
        old_members, old_name, old_labels = self.members, self.group_id, self.labels
        self.members = [u for u in self.engine_urls if reported[u] is not None]
        self.labels = {u: reported[u] for u in self.members}  # type: ignore[misc]
        # an engine that left or reports another version than this updater left on it was restarted:
        # it holds no adapter (its first adapter load is then the first, see _unload_adapter)
        self._adapter_loaded = {u for u in self._adapter_loaded if old_labels.get(u) == self.labels.get(u)}
        if old_name:  # this updater's previous group, on the engines that were in it and still answer
            self._best_effort(
                [u for u in old_members if u in self.members], "/destroy_weights_update_group", {"group_name": old_name}
            )
        self._all("/continue_generation")  # a learner killed mid-push leaves its engines paused
        self.group_id = f"{self.group_name}-{uuid.uuid4().hex[:8]}"
        if not self.members:
            self.rank_offsets, self.world_size = [], 0
            return
        self.rank_offsets, self.world_size = rank_layout(self.engine_layout(self.members))
        sock = self._bind_store_socket()
        port = sock.getsockname()[1]
        futures = self._fire(
            self.members,
            "/init_weights_update_group",
            lambda i: {
                "master_address": self.master_address,
                "master_port": port,
                "rank_offset": self.rank_offsets[i],
                "world_size": self.world_size,
                "group_name": self.group_id,
                "backend": self.backend,
            },
        )
        joined: concurrent.futures.Future = concurrent.futures.Future()

        def join() -> None:  # a daemon thread: an engine that never joins must not keep the process alive
            try:
                joined.set_result(
                    init_weight_group(
                        self.backend,
                        self.master_address,
                        port,
                        self.world_size,
                        0,
                        self.group_id,
                        self.timeout_s,
                        listen_socket=sock,
                    )
                )
            except BaseException as e:
                joined.set_exception(e)

        threading.Thread(target=join, name="weight-group-join", daemon=True).start()
        concurrent.futures.wait([joined, *futures], return_when=concurrent.futures.FIRST_EXCEPTION)
        refused = [f for f in futures if f.done() and f.exception() is not None]
        if refused:
            kind = EngineLost if any(isinstance(f.exception(), EngineLost) for f in refused) else WeightUpdateError
            raise kind("cannot create the weight group: " + "; ".join(str(f.exception()) for f in refused))
        self.group = joined.result()
        self._collect(futures)
        self.group_port = port
        log.info(
            "weight group %r: %d engine(s), world size %d, rank offsets %s, %s:%d (%s)",
            self.group_id,
            len(self.members),
            self.world_size,
            self.rank_offsets,
            self.master_address,
            port,
            self.backend,
        )

    def _bind_store_socket(self):
        """The store's socket on ``master_port`` (0: a free one). A fixed port (clusters) is the
        old group's until its store is gone: asked again for a few seconds."""
        deadline = time.monotonic() + 10.0
        while True:
            try:
                return bind_store_socket(self.master_address, self.master_port)
            except ValueError:
                if not self.master_port or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _best_effort(self, urls: list[str], path: str, body: dict) -> None:
        """POST to ``urls``; a failure only logged (cleaning up what may be gone already)."""
        for url, f in zip(urls, self._fire(urls, path, lambda i: body)):
            try:
                f.result()
            except WeightUpdateError as e:
                log.debug("%s%s: %s", url, path, e)

    def _drop_group(self) -> None:
        """Destroy this end of the group. Its sockets close when the last reference to it goes (not
        at ``destroy_process_group``), so it is dropped here and collected: an engine blocked in a
        receive from the trainer then fails at once instead of holding its scheduler until the
        group's timeout."""
        import gc

        if self.group is not None:
            destroy_weight_group(self.group)
            self.group = None
            gc.collect()

    # -- updates ------------------------------------------------------------------------------
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """Send full tensors (not DTensors: use :func:`push_weights` on every learner rank)."""
        from torch.distributed.tensor import DTensor

        named = without_tied_head(named_tensors)
        for name, t in named:
            if isinstance(t, DTensor):
                raise TypeError(f"{name} is a DTensor: call push_weights(model, updater, ...) on every learner rank")
        return self.push_plan(
            plan_buckets(named, self.bucket_bytes), version, lambda b: full_tensors(b, device=self.device)
        )

    def push_plan(self, plan: Sequence[Bucket], version: int, materialize: Callable[[Bucket], Bucket]) -> dict:
        """One update (module docstring) to every member. ``materialize`` turns a planned bucket into
        full tensors on :attr:`device`; it is called exactly once per bucket, in order, also when
        the update fails or no engine is in the group (the gathers behind it are collectives).
        Returns timings (seconds) and sizes.

        Right after the pause every member is told the version ``"default"`` (no policy): a
        number is left on an engine only by a complete update, so an update that fails half-way
        (an engine or the learner dies, a bucket is refused) never leaves mixed weights
        answering under a policy's number; actors wait on ``"default"`` until a push completes.
        A failure destroys this end of the group first (an engine still blocked in a receive
        then fails instead of holding its scheduler), then ends and continues as always, and
        raises: :class:`EngineLost` when an engine did not answer or the broadcast broke (re-form
        with :meth:`connect`, push again), :class:`WeightUpdateError` when one refused."""
        if not plan:
            raise ValueError("nothing to push: the plan has no bucket")
        t0 = time.perf_counter()
        stats: dict[str, Any] = {"bytes": 0, "num_tensors": 0, "num_buckets": 0, "gather_s": 0.0, "broadcast_s": 0.0}
        gathered = [0]  # how many buckets materialize was called for
        t_paused = t_updated = t0
        try:
            if self.group is None:
                self.connect()
            if not self.members:
                log.warning(
                    "no engine answers: policy version %d reaches no engine (they get it when they answer)", version
                )
                return {"total_s": 0.0, **stats}
            try:
                self._all("/pause_generation", {"mode": self.pause_mode})
                t_paused = time.perf_counter()
                try:
                    # version "default" and the session, independent of each other, are asked at once, and
                    # the first bucket gathered meanwhile; every answer is in before anything else is asked
                    label = self._fire(self.members, "/update_weight_version", lambda i: self._unset_version)
                    calls = label + self._session_calls("/begin_weight_update")
                    try:
                        first = [self._prepare(plan[0], materialize, stats, gathered)]  # _send_plan takes it out
                    finally:
                        concurrent.futures.wait(calls)
                        # what each member reports now, also when another failed (membership_change reads it)
                        self.labels.update({u: UNSET_VERSION for u, f in zip(self.members, label) if not f.exception()})
                    self._collect(calls)
                    self._send_plan(plan, str(version), first, materialize, stats, gathered)
                except BaseException:
                    self._drop_group()
                    raise
                finally:
                    self._finish("/end_weight_update")
            finally:  # also after a failed pause: the engines that did pause must not stay paused
                t_updated = time.perf_counter()
                self._finish("/continue_generation")
            self.labels = {u: str(version) for u in self.members}
        except BaseException:
            self._drop_group()
            raise
        finally:
            for bucket in plan[gathered[0] :]:  # the other learner ranks are in these gathers
                materialize(bucket)
        t1 = time.perf_counter()
        return {
            "pause_s": t_paused - t0,
            "update_s": t_updated - t_paused,
            "continue_s": t1 - t_updated,
            "total_s": t1 - t0,
            **stats,
        }

    _unset_version = {"new_version": UNSET_VERSION, "abort_all_requests": False}  # the body of _label(UNSET_VERSION)

    def _label(self, version: str) -> None:
        """Every member reports ``version`` from now on (``/update_weight_version``; nothing aborted)."""
        self._all("/update_weight_version", {"new_version": version, "abort_all_requests": False})
        self.labels = {u: version for u in self.members}

    def _finish(self, path: str, urls: list[str] | None = None) -> None:
        """End or continue: always attempted. Called from ``finally``: while another error is on
        its way out (``sys.exc_info()`` sees it there), a failure here is logged, not raised over it."""
        import sys

        try:
            if path == "/end_weight_update":
                self._session(path)
            else:
                self._all(path, urls=urls)
        except WeightUpdateError as e:
            if sys.exc_info()[0] is None:
                raise
            log.error("%s failed during a failed update: %s", path, e)

    def _send_plan(
        self,
        plan: Sequence[Bucket],
        version: str,
        first: list[tuple[list[torch.Tensor], dict[str, Any]]],
        materialize: Callable[[Bucket], Bucket],
        stats: dict,
        gathered: list,
    ) -> None:
        """The buckets in order (``first`` holds the first one, prepared): per bucket the HTTP update fired
        at every member, the broadcasts, the answers (an engine takes a bucket only after the one
        before), then the next bucket gathered. With ``flattened_bucket`` the next bucket is gathered
        and packed before the answers, while the engines apply: a packed bucket's tensors are gone
        already, so one gathered bucket is held at a time either way (a broadcast tensor may stay
        referenced by the process group for a moment after its wait)."""
        flattened = self.load_format == "flattened_bucket"
        payload, body = first.pop()
        for i in range(len(plan)):
            if i == len(plan) - 1:  # the last bucket sets the version and flushes the cache
                body.update(weight_version=version, flush_cache=self.flush_cache)
            futures = self._fire(self.members, "/update_weights_from_distributed", lambda _, b=body: b)
            t0 = time.perf_counter()
            broken = self._broadcast(payload)
            if broken:
                raise EngineLost(f"the broadcast to the weight group failed: {broken}")
            stats["broadcast_s"] += time.perf_counter() - t0
            stats["bytes"] += sum(t.numel() * t.element_size() for t in payload)
            stats["num_tensors"] += len(body["names"])
            stats["num_buckets"] += 1
            payload = []  # gone before the next gather
            if flattened and i + 1 < len(plan):
                payload, body = self._prepare(plan[i + 1], materialize, stats, gathered)
            self._collect(futures)
            if not flattened and i + 1 < len(plan):
                payload, body = self._prepare(plan[i + 1], materialize, stats, gathered)

    def _prepare(
        self, bucket: Bucket, materialize: Callable[[Bucket], Bucket], stats: dict, gathered: list
    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Gather one bucket: what is broadcast (its tensors, or for ``flattened_bucket`` their bytes
        in one buffer) and the body of its HTTP update."""
        t0 = time.perf_counter()
        gathered[0] += 1  # counted before: a failed gather is not retried
        full = materialize(bucket)
        body: dict[str, Any] = {
            "names": [n for n, _ in full],
            "dtypes": [dtype_name(t.dtype) for _, t in full],
            "shapes": [list(t.shape) for _, t in full],
            "group_name": self.group_id,
            "flush_cache": False,
        }
        flattened = self.load_format == "flattened_bucket"
        if flattened:
            body["load_format"] = "flattened_bucket"
        payload = [self._pack([t for _, t in full])] if flattened else [t for _, t in full]
        _settle(payload[0].device)  # CUDA: the gather's time is its own, not the broadcast's
        stats["gather_s"] += time.perf_counter() - t0
        return payload, body

    def _pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors' bytes, concatenated in order into one buffer (SGLang's ``flattened_bucket``). On
        the CPU a buffer kept across buckets and pushes: a fresh one of a bucket's size costs a page
        fault per 4 KiB, more than the copy (on CUDA the caching allocator keeps blocks already). It is
        written again only after the previous broadcast has completed (``_broadcast`` settles)."""
        import torch

        device = tensors[0].device
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if device.type != "cpu":
            flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            if self._staging is None or self._staging.numel() < nbytes:
                self._staging = None  # freed before the larger one is allocated
                self._staging = torch.empty(nbytes, dtype=torch.uint8)
            flat = self._staging[:nbytes]
        torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors], out=flat)
        return flat

    def push_adapter(self, folder: str | Path, version: int, name: str = LORA_ADAPTER_NAME) -> dict:
        """Load the PEFT adapter ``folder`` as ``name`` on every member (module docstring, "LoRA
        adapters alone") and set their ``weight_version``; returns timings. As with full weights,
        the members report ``"default"`` from the pause until the adapter is in, so a swap that
        fails half-way never answers under a policy's number. No broadcast: no group is needed,
        but the members are the engines that answer (:meth:`connect`)."""
        if self.pause_mode != "abort":
            raise ValueError(
                f"adapter updates need pause_mode 'abort', got {self.pause_mode!r}: SGLang's unload waits "
                "for every request that uses the adapter, and paused requests keep it"
            )
        if self.group is None:
            self.connect()
        t0 = t_paused = time.perf_counter()
        try:
            self._all("/pause_generation", {"mode": self.pause_mode})
            t_paused = time.perf_counter()
            self._label(UNSET_VERSION)
            self._collect([self._pool.submit(self._unload_adapter, url, name) for url in self.members])
            self._all("/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(folder).resolve())})
            self._adapter_loaded.update(self.members)
            self._label(str(version))
        finally:
            t_updated = time.perf_counter()
            self._finish("/continue_generation")
        t1 = time.perf_counter()
        return {
            "pause_s": t_paused - t0,
            "update_s": t_updated - t_paused,
            "continue_s": t1 - t_updated,
            "total_s": t1 - t0,
        }

    def _unload_adapter(self, url: str, name: str) -> None:
        """``/unload_lora_adapter``; before this updater's first load the engine may not hold it
        (a fresh engine) or may (a restarted learner): a refusal then is no error."""
        try:
            self._post(url, "/unload_lora_adapter", {"lora_name": name})
        except WeightUpdateError as e:
            if url in self._adapter_loaded or e.status != 400:
                raise
            log.debug("%s: no adapter %r to unload before the first load (%s)", url, name, e)
        self._adapter_loaded.discard(url)

    def _broadcast(self, tensors: Sequence[torch.Tensor]) -> str:
        """Broadcast ``tensors`` in order (all posted at once, then waited for, then the device
        settled); ``""``, or why it broke (a member is gone). Nothing of the broadcast outlives this
        call, not even in a traceback: the group's sockets close only when its last reference does,
        and a member still waiting in a receive is released only then (``_drop_group``)."""
        import torch.distributed as dist

        works: list = []
        try:
            works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]
            for w in works:
                w.wait()
            _settle(tensors[0].device)  # NCCL: wait() only orders the stream; the host waits here
        except RuntimeError as e:  # torch's DistBackendError too
            return f"{type(e).__name__}: {e}"
        finally:
            works.clear()
        return ""

    def push_from_disk(self, model_path: str, version: int) -> None:
        """Fallback: every configured engine loads ``model_path`` (a folder visible to it) between
        pause and continue; no group needed."""
        urls = self.engine_urls
        try:
            self._all("/pause_generation", {"mode": self.pause_mode}, urls)
            self._all(
                "/update_weights_from_disk",
                {"model_path": str(model_path), "weight_version": str(version), "flush_cache": self.flush_cache},
                urls,
            )
            self.labels.update({u: str(version) for u in self.members})
        finally:
            self._finish("/continue_generation", urls)

    def unload_adapter_everywhere(self, name: str = LORA_ADAPTER_NAME) -> None:
        """``/unload_lora_adapter`` on every configured engine, a refusal (none loaded) only logged."""
        self._best_effort(self.engine_urls, "/unload_lora_adapter", {"lora_name": name})
        self._adapter_loaded.clear()

    def close(self) -> None:
        if self.group is not None:
            for f in self._fire(self.members, "/destroy_weights_update_group", lambda i: {"group_name": self.group_id}):
                try:
                    f.result(timeout=10)
                except Exception as e:  # the engine may be gone already
                    log.debug("destroy_weights_update_group: %s", e)
            self._drop_group()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for http in self._https:
            http.close()
        self._staging = None

    def __enter__(self) -> WeightUpdater:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
