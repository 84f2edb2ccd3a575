"""One worker thread owns the engine; requests from any thread or event loop become jobs it runs step by step.

The engine is not thread-safe, so everything that touches it runs on the worker: generations as jobs, anything
else (tokenising, reading session state) through `call`. The worker runs ticks. In a tick every active job
advances to its next forward (taking in the logits of its last one, handing out its text, drafting), and then
one forward runs for all of them (decode.py): the draft lengths are chosen for the batch as a whole, and every
session's rows (a decode step, a verify, a chunk of a prompt) go through the weights together, each against its
own KV cache. So eight editors cost little more than one, a long refactor slows a short completion down but never
holds it back, and a cold prompt runs in chunks between other jobs' steps. Jobs on the same session never
interleave: the second waits until the first is done, because both would rewrite the same history and KV cache.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator
from concurrent.futures import Future

from .config import ServerConfig
from .decode import Propose, forward_batch, verify_lengths
from .forward import Rows
from .errors import CodespecError

_END = object()  # the last item of every job's output
_ids = itertools.count(1)


class QueueFull(CodespecError):
    """Too many jobs are waiting; the HTTP server answers 429."""


class Job:
    """One generation. Iterate it (threads) or `async for` it (asyncio) for its chunks; the last chunk carries the
    result. Errors from the engine are raised to the consumer. A cancelled job's iteration just ends."""

    def __init__(self, scheduler: "Scheduler", steps: Callable, session_id: str | None):
        self.id = next(_ids)
        self.session_id = session_id
        self._make_steps = steps  # steps(engine) -> the iterator the worker advances one item per turn
        self.cancelled = False
        self.result = None  # GenerationResult, once finished
        self.error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None  # when the worker took it up (queue wait = started - submitted)
        self.finished_at: float | None = None
        self._scheduler = scheduler
        self._stream = None  # the engine's generator, created on the worker
        self._reply = None  # the answer to the last request it made (decode.py), sent when it next runs
        self._items: list = []
        self.produced = 0  # items pushed to its consumer so far (a generation's first: its prompt is cached)
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def cancel(self) -> None:
        """Thread-safe. The worker drops the job at the next step boundary and frees its slot."""
        self.cancelled = True
        self._scheduler._wake()

    def _push(self, item) -> None:
        with self._cond:
            self.produced += 1
            self._items.append(item)
            self._cond.notify_all()
            waiters = list(self._async_waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that event loop has closed: nobody is listening there any more
                pass

    def __iter__(self) -> Iterator:
        index = 0
        while True:
            with self._cond:
                while index >= len(self._items):
                    self._cond.wait()
                item = self._items[index]
            index += 1
            if _ended(item):
                return
            yield item

    async def __aiter__(self) -> AsyncIterator:
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._async_waiters.append((loop, event))
        index = 0
        try:
            while True:
                event.clear()  # cleared before looking, so a push between the look and the wait still wakes us
                with self._cond:
                    available = self._items[index:]
                if not available:
                    await event.wait()
                    continue
                for item in available:
                    index += 1
                    if _ended(item):
                        return
                    yield item
        finally:
            with self._cond:
                self._async_waiters.remove((loop, event))

    def wait(self):
        """Block until the job ends; its GenerationResult (None if cancelled). Raises the engine's error."""
        for _ in self:
            pass
        return self.result

    async def await_result(self):
        async for _ in self:
            pass
        return self.result


def _generator(steps: Iterable) -> Generator:
    """A job's steps as what the worker advances (send, close): a plain iterable is wrapped in a generator."""
    return steps if inspect.isgenerator(steps) else _wrapped(steps)


def _wrapped(steps: Iterable) -> Generator:
    return (yield from steps)


def _ended(item) -> bool:
    """Whether a job's stream ends at this item; an engine error is raised where the stream is read."""
    if isinstance(item, BaseException):
        raise item
    return item is _END


class Scheduler:
    # Requests leave reference cycles behind (a client that disconnects mid-stream leaves its async generators'
    # frames in a cycle with their exception, logits included). Python frees cycles in full collections, which
    # come rarer as a server holds more objects: a 20-minute soak grew 800 MB besides the KV caches before one
    # came and freed 470 MB at once. So the worker collects every COLLECT_SECONDS, after a job ends; the objects
    # that exist when the scheduler starts (the model, the libraries) are frozen out of those collections.
    COLLECT_SECONDS = 10.0

    def __init__(self, engine, max_queue: int = ServerConfig.max_queue, max_active: int = ServerConfig.parallel):
        """max_queue: jobs waiting to start before submit raises QueueFull; max_active: jobs that take turns."""
        gc.collect()
        gc.freeze()
        self._collected_at = time.perf_counter()
        self.engine = engine
        self.max_queue, self.max_active = max_queue, max_active
        self._pending: deque[Job] = deque()
        self._active: list[Job] = []
        self._calls: deque[tuple[Callable, tuple, dict, Future]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.steps = 0  # items jobs have produced, all jobs together
        self.ticks = 0  # batched forwards run
        self.batched_ticks = 0  # of those, forwards over more than one job's rows
        self._thread = threading.Thread(target=self._run, name="codespec-engine", daemon=True)
        self._thread.start()

    # -- what other threads call ------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def active(self) -> int:
        return len(self._active)

    def busy_sessions(self) -> set[str]:
        """Sessions with a job queued or running (a new job on one of them would wait)."""
        with self._cond:
            return {job.session_id for job in (*self._active, *self._pending) if job.session_id is not None}

    def submit(self, prompt, params=None, session_id: str | None = None, spec=None, chat: bool = False,
               **options) -> Job:
        """Queue a generation; options go to engine.stream unchanged. Raises QueueFull when the queue is full."""
        def steps(engine):  # a cold prompt goes in chunks, each batched with the other jobs' steps
            return engine.stream_steps(prompt, params, session_id=session_id, spec=spec, chat=chat,
                                       prefill_chunk=ServerConfig.prefill_chunk, **options)

        return self.submit_steps(steps, session_id=session_id)

    def submit_steps(self, steps: Callable, session_id: str | None = None) -> Job:
        """Queue any stepwise work: steps(engine) returns an iterator; each item it yields is one turn (items
        with a `result` are the job's result and end it). For work that must not hold the engine for long, such as
        a prefill in chunks followed by a generation. Raises QueueFull when the queue is full."""
        job = Job(self, steps, session_id)
        with self._cond:
            if self._closed:
                raise CodespecError("the scheduler is closed")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self._pending.append(job)
            self._cond.notify_all()
        return job

    def call(self, fn: Callable, *args, **kwargs):
        """Run fn(engine, *args, **kwargs) on the worker between two steps; block for its result."""
        if threading.current_thread() is self._thread:
            return fn(self.engine, *args, **kwargs)
        return self._call_future(fn, args, kwargs).result()

    def call_soon(self, fn: Callable, *args, **kwargs) -> Future:
        """`call` without waiting: fn(engine, ...) runs on the worker before its next step; its Future."""
        return self._call_future(fn, args, kwargs)

    async def acall(self, fn: Callable, *args, **kwargs):
        """`call` for asyncio: awaits instead of blocking the event loop."""
        return await asyncio.wrap_future(self._call_future(fn, args, kwargs))

    def close(self) -> None:
        """Stop the worker; jobs still queued or running end with an error."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # -- the worker -------------------------------------------------------------------------------------------

    def _call_future(self, fn, args, kwargs) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise CodespecError("the scheduler is closed")
            self._calls.append((fn, args, kwargs, future))
            self._cond.notify_all()
        return future

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._calls or self._active or self._pending):
                    self._cond.wait()
                if self._closed:
                    break
                self._admit()
                turn = list(self._active)
                if not turn and not self._calls:
                    # only jobs that wait for nothing but a cancellation or a slot: sleep until something changes
                    self._cond.wait(timeout=0.05)
                    continue
            self._run_calls()  # calls (cheap: tokenising, reading state) go ahead of the next tick
            self._tick(turn)
        self._shutdown()

    def _tick(self, turn: list[Job]) -> None:
        """Every job up to its next request, the batch's draft lengths, one forward for all."""
        waiting = {}
        for job in turn:
            request = self._advance(job)
            if request is not None:
                waiting[job] = request
        proposing = [job for job, request in waiting.items() if isinstance(request, Propose)]
        if proposing:
            rows = [request for request in waiting.values() if isinstance(request, Rows)]
            lengths = verify_lengths(self.engine.costs, [waiting[job] for job in proposing], rows)
            for job, length in zip(proposing, lengths):
                job._reply = length
                request = self._advance(job)  # its verify forward
                if request is None:
                    del waiting[job]
                else:
                    waiting[job] = request
        if not waiting:
            return
        jobs = list(waiting)
        try:
            logits = forward_batch(self.engine.path, [waiting[job] for job in jobs], self.engine._costs)
        except Exception as exc:  # not one job's fault: every job in the forward ends with the error
            for job in jobs:
                self._fail(job, exc)
            return
        for job, rows in zip(jobs, logits):
            job._reply = rows
        self.ticks += 1
        self.batched_ticks += len(jobs) > 1

    def _advance(self, job: Job):
        """Run the job until it asks the engine for something (a Propose or Rows, returned) or ends (None). Items
        it yields on the way go to its consumer. A generation yields at most one item between two requests, so a
        second one means a job that asks the engine for nothing: its turn ends there (None), and calls and other
        jobs go next."""
        items = 0
        while True:
            if items > 1:
                return None
            if job.cancelled:
                self._retire(job)
                return None
            try:
                if job._stream is None:
                    job._stream = _generator(job._make_steps(self.engine))
                    job._make_steps = None  # it often holds its frontend's run, which holds the job: no cycle
                    item = next(job._stream)
                else:
                    reply, job._reply = job._reply, None
                    item = job._stream.send(reply)
            except StopIteration:
                self._retire(job)
                return None
            except Exception as exc:  # the consumer re-raises it: CodespecError is the client's, others are bugs
                self._fail(job, exc)
                return None
            if isinstance(item, (Propose, Rows)):
                return item
            self.steps += 1
            items += 1
            result = getattr(item, "result", None)
            if result is not None:
                job.result = result
            job._push(item)
            if result is not None:
                self._retire(job)
                return None

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.error = exc
        job._push(exc)
        self._retire(job)

    def _admit(self) -> None:
        """Move waiting jobs to the active list, in order, skipping those whose session is busy.
        Called with the lock held."""
        for job in [job for job in self._pending if job.cancelled]:
            self._pending.remove(job)
            self._finish(job)
        busy = {job.session_id for job in self._active if job.session_id is not None}
        for job in list(self._pending):
            if len(self._active) >= self.max_active:
                break
            if job.session_id is not None and job.session_id in busy:
                continue
            self._pending.remove(job)
            job.started_at = time.perf_counter()
            self._active.append(job)
            if job.session_id is not None:
                busy.add(job.session_id)

    def _run_calls(self) -> None:
        while True:
            with self._cond:
                if not self._calls:
                    return
                fn, args, kwargs, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine, *args, **kwargs))
            except BaseException as exc:  # handed to the caller, who decides what it means
                future.set_exception(exc)

    def _retire(self, job: Job) -> None:
        if job._stream is not None:
            job._stream.close()  # the engine's generator ends here: the session stays consistent between steps
            job._stream = None
        with self._cond:
            if job in self._active:
                self._active.remove(job)
        self._finish(job)
        evict = getattr(self.engine, "evict", None)
        if evict is not None:  # sessions over the memory bound go, least recently used first, never a busy one
            evict(keep=self.busy_sessions())
        if time.perf_counter() - self._collected_at >= self.COLLECT_SECONDS:
            gc.collect()
            self._collected_at = time.perf_counter()

    @staticmethod
    def _finish(job: Job) -> None:
        job.finished_at = time.perf_counter()
        job._push(_END)

    def _shutdown(self) -> None:
        with self._cond:
            jobs = list(self._active) + list(self._pending)
            self._active.clear()
            self._pending.clear()
            calls = list(self._calls)
            self._calls.clear()
        for job in jobs:
            if job._stream is not None:
                job._stream.close()
            job._push(CodespecError("the server is shutting down"))
            self._finish(job)
        for _, _, _, future in calls:
            future.cancel()
