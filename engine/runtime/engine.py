"""The Engine: one long-lived thread that owns MLX, the model and every generation.

MLX streams belong to the thread that made them (mlx-lm #1181), so the model is loaded and run
on one thread only. Callers submit a request and iterate its events from a queue; `cancel()` is
checked between tokens.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import traceback
from time import perf_counter

from flashmoe.engine.options import IO_THREADS
from flashmoe.engine.errors import FlashMoEError, ModelLoadError
from flashmoe.engine.events import EngineFailed, GenerationFinished, ModelLoaded
from flashmoe.engine.runtime.generate import TRUNCATE_MODES, GenerationRequest, Session, generate, model_bits

_STOP = object()
USAGE_SAVE_EVERY_S = 60.0  # a long-lived server keeps its usage file current; others write at close


def _warn(text: str) -> None:
    import logging

    logging.getLogger("flashmoe").warning("flashmoe: warning: %s", text)


class Handle:
    """The events of one submitted request; iterate it, or cancel it."""

    def __init__(self, request: GenerationRequest, session: str, tenant: str = ""):
        self.request = request
        self.session = session
        self.tenant = tenant  # with no session: whose cached prompts the pool may give it
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def get(self, timeout: float | None = None):
        """The next event. Safe to call again after a KeyboardInterrupt, unlike a generator."""
        return self.events.get(timeout=timeout)

    def __iter__(self):
        while True:
            ev = self.get()
            yield ev
            if isinstance(ev, (GenerationFinished, EngineFailed)):
                return


class Engine:
    def __init__(
        self,
        model_path,
        *,
        expert_cache: int | None = None,
        io_threads: int = IO_THREADS,
        direct_io: bool | None = None,
        dtype: str | None = None,
        kernels: str = "mlx",
        kv_cache: str = "float32",
        prefetch: bool | str = False,
        cache_policy: str = "lfu",
        verify_reads: bool = True,
        truncate_prompt: str = "off",
        allow_resident_experts: bool = False,
        prompt_cache_bytes: int = 2 << 30,
        prompt_cache_dir=None,
        prompt_cache_disk_bytes: int = 8 << 30,
        experts_per_token: int | None = None,
        expert_usage: bool = False,
        usage_file=None,
        ctx_size: int | None = None,
    ):
        """truncate_prompt: for requests that do not say, what to do with a prompt longer than the
        model's context (generate.TRUNCATE_MODES). expert_usage: learn which experts this model's
        runs use in a file kept across runs, and preload the hottest at start (experts/usage.py);
        usage_file: that file, instead of the one beside the model (benchmarks).
        The rest are loader.load's options."""
        if truncate_prompt not in TRUNCATE_MODES:
            raise ValueError(f"truncate_prompt must be one of {', '.join(TRUNCATE_MODES)}, got {truncate_prompt!r}")
        self.model_path = model_path
        self.truncate_prompt = truncate_prompt
        self._load_args = dict(
            expert_cache=expert_cache,
            io_threads=io_threads,
            direct_io=direct_io,
            dtype=dtype,
            kernels=kernels,
            kv_cache=kv_cache,
            prefetch=prefetch,
            cache_policy=cache_policy,
            verify_reads=verify_reads,
            allow_resident_experts=allow_resident_experts,
            experts_per_token=experts_per_token,
            ctx_size=ctx_size,
            prompt_cache=prompt_cache_bytes,
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loaded_event = threading.Event()
        self._stopped = threading.Event()
        self._current: Handle | None = None
        self.loaded_info: ModelLoaded | None = None
        self.load_error: BaseException | None = None
        self.loaded = None
        self._sessions: dict[str, Session] = {}
        self._prompt_cache = (prompt_cache_bytes, prompt_cache_dir, prompt_cache_disk_bytes)
        self.pool = None  # PromptCachePool, made with the model
        self._expert_usage = expert_usage
        self._usage_file = usage_file
        self.usage = None  # experts/usage.Usage, with expert_usage and a streamed model
        self._usage_saved_at = 0.0
        # mlx-lm imports transformers; doing that first on a non-main thread can abort the
        # process at exit ("terminate called without an active exception"), so import it here.
        import mlx_lm.utils  # noqa: F401  (pyflakes: needed for its side effect)

        self._thread = threading.Thread(target=self._run, name="flashmoe-engine", daemon=True)
        self._thread.start()

    # -- caller side -----------------------------------------------------------------------
    def wait_loaded(self, timeout: float | None = None) -> ModelLoaded:
        """Block until the model is loaded; re-raises the load error, if any; None on timeout."""
        self._loaded_event.wait(timeout)
        if self.load_error is not None:
            raise self.load_error
        return self.loaded_info

    def submit(self, request: GenerationRequest, session: str | None = "default", tenant: str = "") -> Handle:
        """session: the conversation whose cache the request continues; None: the prompt-cache
        pool picks the cached prompt it shares most with (engine/runtime/prompt_cache.py), among
        those of the same `tenant` (a server's clients never reuse, or time, each other's)."""
        handle = Handle(request, session, tenant)
        self._inbox.put(handle)
        return handle

    def reset_session(self, session: str = "default") -> None:
        self._inbox.put(("reset", session))

    def close(self) -> None:
        if self._current is not None:
            self._current.cancel()
        self._inbox.put(_STOP)
        self._stopped.wait(timeout=10)

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        from flashmoe.engine.runtime.loader import load

        t0 = perf_counter()
        try:
            self.loaded = load(self.model_path, **self._load_args)
            lm = self.loaded
            self.loaded_info = ModelLoaded(
                model=str(lm.path),
                model_type=lm.config["model_type"],
                mode=lm.mode,
                layers=lm.num_layers,
                moe_layers=len(lm.layers),
                experts=lm.layers[0].num_experts if lm.layers else 0,
                top_k=lm.top_k,
                bits=model_bits(lm.config),
                cache_bytes=lm.store.capacity_bytes if lm.store else 0,
                load_s=perf_counter() - t0,
                chat_template=lm.tokenizer.template_source if lm.tokenizer else "",
                kernels="cpu-int8" if lm.int8_matrices else lm.kernels,
                kv_cache=lm.kv_cache,
                cache_policy=lm.store.policy if lm.store else "",
                context=lm.context,
                resident_experts=lm.resident_experts,
                trained_top_k=lm.trained_top_k,
            )
            if self._expert_usage and lm.store is not None:
                self.loaded_info = self._start_usage(lm)
        except BaseException as e:  # reported to the caller by wait_loaded
            self.load_error = e
        if self.loaded is not None:
            from flashmoe.engine.runtime.prompt_cache import DiskPromptCache, PromptCachePool

            budget, folder, disk_bytes = self._prompt_cache
            disk = None
            if folder is not None and disk_bytes > 0:
                try:
                    disk = DiskPromptCache(folder, self.loaded.path, disk_bytes, self.loaded.kv_cache)
                except OSError as e:  # the caches stay in memory
                    import logging

                    logging.getLogger("flashmoe").warning("flashmoe: warning: no prompt caches on disk: %s", e)
            if self.loaded.memory is not None:  # the share of the memory plan (runtime/memory.py)
                budget = self.loaded.memory.prompt_caches
            self.pool = PromptCachePool(self.loaded, budget, disk=disk)
        self._loaded_event.set()

        while True:
            item = self._inbox.get()
            if item is _STOP:
                break
            if isinstance(item, tuple) and item[0] == "reset":
                self._sessions.pop(item[1], None)
                continue
            try:
                self._serve(item)
                self._save_usage(every_s=USAGE_SAVE_EVERY_S)
            except Exception as e:  # noqa: BLE001  no one request may end the thread every later one needs
                _warn(f"a request failed: {type(e).__name__}: {e}")
                item.events.put(EngineFailed(f"{type(e).__name__}: {e}", type(e).__name__, 1))
        self._save_usage()
        if self.loaded is not None:
            self.loaded.close()
        self._stopped.set()
        # Park instead of returning: when a thread that used MLX exits, its thread-local
        # streams are torn down and the process can abort at exit. A parked daemon thread
        # simply ends with the process.
        threading.Event().wait()

    def _start_usage(self, lm) -> ModelLoaded:
        """Read the usage file and start preloading from it; what ModelLoaded then says."""
        from flashmoe.engine.experts.usage import Usage

        self.usage = Usage(lm.store, lm.path, self._usage_file)
        started, warning = self.usage.start()
        if warning:
            _warn(warning)
        self._usage_saved_at = perf_counter()
        return dataclasses.replace(
            self.loaded_info,
            preloading=started,
            preloading_bytes=lm.store.preloaded_bytes,
            usage_file=str(self.usage.path),
        )

    def _save_usage(self, every_s: float = 0.0) -> None:
        """Add this process's expert counts to the usage file (at most every `every_s` seconds)."""
        if self.usage is None or perf_counter() - self._usage_saved_at < every_s:
            return
        warning = self.usage.save()
        self._usage_saved_at = perf_counter()
        if warning:
            _warn(warning)
            self.usage = None  # said once; not tried again

    def _serve(self, handle: Handle) -> None:
        if self.loaded is None:
            handle.events.put(EngineFailed(f"model not loaded: {self.load_error}", type(self.load_error).__name__, 3))
            return
        self._current = handle
        request = handle.request
        if request.truncate_prompt is None:
            request = dataclasses.replace(request, truncate_prompt=self.truncate_prompt)
        session = Session(self.loaded)  # replaced by the request's own (its reset is then a no-op)
        try:
            session = self._session_for(handle, request)
            for ev in generate(self.loaded, session, request, handle._cancel):
                handle.events.put(ev)
        except ModelLoadError as e:  # a read failed mid-generation: an I/O problem, exit 3
            session.reset()
            handle.events.put(EngineFailed(str(e), type(e).__name__, 3))
        except (FlashMoEError, ValueError) as e:
            session.reset()
            handle.events.put(EngineFailed(str(e), type(e).__name__, getattr(e, "exit_code", 1)))
        except Exception as e:  # a bug: keep the traceback for the log
            session.reset()
            handle.events.put(EngineFailed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}", type(e).__name__, 1))
        finally:
            self._current = None
            if handle.session is None:
                self.pool.settle()  # its budget, and the cache saved to disk
            elif self.pool.disk is not None:
                self.pool.save(session)

    def _session_for(self, handle: Handle, request: GenerationRequest) -> Session:
        """A conversation's own session (a new one starts from the longest saved prefix on disk,
        when there are saved caches), or, with no key, the pool's pick for the handle's tenant."""
        from flashmoe.engine.runtime.generate import render_prompt

        key = handle.session
        if key is None:
            return self.pool.pick(render_prompt(self.loaded, request), tenant=handle.tenant)
        session = self._sessions.get(key)
        if session is None:
            session = self.pool.saved(render_prompt(self.loaded, request)) if self.pool.disk is not None else None
            session = self._sessions[key] = session or Session(self.loaded)
        return session
