"""The engine loop of one replica (no Ray here).

Exactly one thread owns the speculative engine. Requests enter through a queue; every
turn of the loop applies cancellations, admits waiting requests into the live batch
(``engine.add`` prefills them together), runs ONE draft/verify cycle for all live rows
(``engine.step(k)`` with the block size the controller picks for this batch) and pushes
each row's new tokens to its ``Stream``, which the replica's asyncio side consumes.

Drafter swaps (the registry alias moved) never touch a live row: the new drafter gets a
new engine *generation* that takes every new request, while older generations keep
stepping until their rows finish, then retire. Exactness never depends on the drafter,
and no draft cache is ever shared between drafters.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import deque


from specdec.engine import Engine, Request
from specdec.proposers import HybridProposer, drafter_proposer, engine_width

from serve_app.adaptive import BlockSizeController, CostModel
from serve_app.metrics import ReplicaMetrics

# a child of Serve's own logger: in a replica its lines land in the replica's log file
log = logging.getLogger("ray.serve.dflash.worker")
#: Seconds between two "speculation on/off" lines of one engine (flips in between are counted).
SPECULATION_LOG_S = 30.0


def plan_admissions(lengths: list[int], room: int, budget: int) -> list[int]:
    """Indices of the waiting prompts (oldest first) to prefill together this turn.

    A batched prefill pads every prompt to the longest, so it costs rows x longest
    tokens, not the sum. The oldest request always goes (when there is room); later ones
    join while the padded cost stays within ``budget``, skipping any that would blow it,
    so short prompts are not padded to a long one. A skipped prompt is only passed while
    an older one heads the queue, so nothing starves.
    """
    picked: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if len(picked) >= room:
            break
        if picked and max(longest, n) * (len(picked) + 1) > budget:
            continue
        picked.append(i)
        longest = max(longest, n)
    return picked


class Stream:
    """One request's output channel: the engine thread pushes, an asyncio task reads.

    Items: ``("tokens", [ids])``, ``("done", finish_reason, stats)``, ``("error", message)``.
    """

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sent = 0  # tokens already pushed
        self.drafted = 0  # draft tokens proposed for this request
        self.max_rows = 0  # largest batch this request was verified in
        self.finished = False

    def push(self, item: tuple) -> None:
        if item[0] != "tokens":
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is gone
            pass

    async def get(self) -> tuple:
        return await self.queue.get()

    def get_nowait(self) -> tuple | None:
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None


class _Generation:
    """An engine with one drafter (or none) and the controller that picks its block size."""

    def __init__(self, target, drafter, version: str, mode, cost: CostModel, seed: int | None,
                 lookup_block: int = 0):
        self.version = version
        B = int(drafter.config.block_size) if drafter is not None else 1
        self.proposer = drafter_proposer(drafter, target, B, lookup_block) if drafter is not None else None
        self.max_block = engine_width(B, lookup_block) if drafter is not None else 1
        self.engine = Engine(target, self.proposer, width=self.max_block, seed=seed)
        self.controller = BlockSizeController(B, mode if drafter is not None else "off", cost,
                                              lookup_block=lookup_block)
        self.drafter = drafter
        self.lookup_block = lookup_block
        self.target, self.B = target, B
        self.speculating: bool | None = None  # the controller's last verdict (probes aside)
        self.flips, self.logged_at = 0, -SPECULATION_LOG_S

    def note(self, rows: int, k: int) -> None:
        """Log when the controller's verdict turns speculation on or off (at most one line
        per ``SPECULATION_LOG_S``): why a replica stopped speculating is then in its log."""
        on = k > 1 and not self.controller.probing
        if self.drafter is None or on == self.speculating:
            return
        self.speculating, self.flips = on, self.flips + 1
        now = time.monotonic()
        if now - self.logged_at < SPECULATION_LOG_S:
            return
        c = self.controller
        extra = f"; {self.flips - 1} switches since the last line" if self.flips > 1 else ""
        log.info("speculation %s at %d rows (drafter version %s): block %d, expected %.2fx AR, tau(B) %.2f%s",
                 "on" if on else "off", rows, self.version or "-", k, c.expected_speedup, c.acceptance.tau(self.B),
                 extra)
        self.flips, self.logged_at = 0, now

    def warm_up(self) -> float:
        """One short request through a throwaway engine, speculating, then a plain one, before
        anything is served (seconds taken). First passes pay one-time costs (allocations,
        kernel packing, lazy initialisation); timed by the controller they made a cold
        replica switch speculation off for a whole short chat. Nothing here is measured."""
        t0 = time.perf_counter()
        prompt = list(range(1, 17))
        if self.drafter is not None:
            proposer = drafter_proposer(self.drafter, self.target, self.B, self.lookup_block)
            Engine(self.target, proposer, width=self.max_block, seed=0).generate(
                [Request(prompt, 2 * self.max_block, stop_ids=frozenset())])
        Engine(self.target, seed=0).generate([Request(prompt, 2, stop_ids=frozenset())])
        return time.perf_counter() - t0


class EngineWorker:
    def __init__(self, target, drafter=None, drafter_version: str = "", *, mode: str | int = "auto",
                 max_batch_size: int = 16, max_prefill_tokens: int = 1024, seed: int | None = None,
                 metrics: ReplicaMetrics | None = None, lookup_block: int = 0):
        self.target = target
        self.mode = mode
        self.lookup_block = lookup_block
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.seed = seed
        self.metrics = metrics or ReplicaMetrics()
        self._gens: list[_Generation] = [_Generation(target, drafter, drafter_version, mode, CostModel(), seed,
                                                     lookup_block)]
        self.metrics.set_max_block(self._gens[0].max_block)
        log.info("engine warmed up in %.1f s", self._gens[0].warm_up())
        self._live: dict[int, tuple[Stream, _Generation]] = {}  # id(request) -> owner
        self._cond = threading.Condition()
        self._waiting: deque[Stream] = deque()
        self._cancels: list[tuple[Stream, str]] = []
        self._next_drafter: tuple | None = None
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> Stream:
        stream = Stream(request, loop or asyncio.get_running_loop())
        with self._cond:
            if self._stop or self.error is not None:
                raise RuntimeError("the engine is not running")
            self._waiting.append(stream)
            self.metrics.load(len(self._waiting), len(self._live))
            self._cond.notify()
        return stream

    def cancel(self, stream: Stream, reason: str = "cancelled") -> None:
        """Drop a request (its client left, or a stop string matched); frees its row."""
        with self._cond:
            if stream in self._waiting:
                self._waiting.remove(stream)
                self.metrics.finished(reason)
                stream.push(("done", reason, {}))
            elif not stream.finished:
                self._cancels.append((stream, reason))
                self._cond.notify()

    def set_drafter(self, drafter, version: str) -> None:
        """Serve new requests with ``drafter`` from the next loop turn on."""
        with self._cond:
            self._next_drafter = (drafter, version)
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def drafter(self):
        return self._gens[0].drafter

    @property
    def drafter_version(self) -> str:
        return self._gens[0].version

    @property
    def max_block(self) -> int:
        """Block size B of the drafter serving new requests (1 without a drafter)."""
        return self._gens[0].max_block

    @property
    def generations(self) -> int:
        return len(self._gens)

    def load(self) -> tuple[int, int]:
        """(waiting, live) request counts."""
        return len(self._waiting), len(self._live)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stop or self._waiting or self._cancels or self._live or self._next_drafter):
                        self._cond.wait()
                    if self._stop:
                        break
                    admit = self._take_admissions()
                    cancels, self._cancels = self._cancels, []
                    swap, self._next_drafter = self._next_drafter, None
                if swap is not None:
                    self._install(*swap)
                for stream, reason in cancels:
                    self._cancel_live(stream, reason)
                if admit:
                    self._admit(admit)
                for gen in list(self._gens):
                    if gen.engine.rows:
                        self._step(gen)
                self._retire()
                self.metrics.load(len(self._waiting), len(self._live))
        except BaseException as e:  # a bug: fail everything loudly, the replica's health check reports it
            log.exception("engine loop died")
            self.error = e
        finally:
            with self._cond:
                leftovers = list(self._waiting) + [s for s, _ in self._live.values()]
                self._waiting.clear()
                self._live.clear()
            why = "the replica is shutting down" if self.error is None else \
                f"engine failure: {type(self.error).__name__}: {self.error}"
            for stream in leftovers:
                if not stream.finished:
                    stream.push(("error", why))

    def _take_admissions(self) -> list[Stream]:
        """Waiting requests for this turn's prefill (see ``plan_admissions``)."""
        room = max(0, self.max_batch_size - len(self._live))
        waiting = list(self._waiting)
        picked = set(plan_admissions([len(s.request.prompt) for s in waiting], room, self.max_prefill_tokens))
        if not picked:
            return []
        self._waiting = deque(s for i, s in enumerate(waiting) if i not in picked)
        return [waiting[i] for i in sorted(picked)]

    def _install(self, drafter, version: str) -> None:
        old = self._gens[0]
        cost = CostModel(verify=copy.deepcopy(old.controller.cost.verify))
        self._gens.insert(0, _Generation(self.target, drafter, version, self.mode, cost, self.seed,
                                         self.lookup_block))
        self.metrics.set_max_block(self._gens[0].max_block)
        log.info("drafter version %s installed; %d rows finish on version %s", version,
                 len(old.engine.rows), old.version)

    def _retire(self) -> None:
        self._gens = [self._gens[0]] + [g for g in self._gens[1:] if g.engine.rows]

    def _admit(self, streams: list[Stream]) -> None:
        gen = self._gens[0]
        ok = []
        for s in streams:
            try:
                gen.engine.check(s.request)  # one bad prompt must not fail its batchmates' prefill
            except ValueError as e:
                self.metrics.finished("error")
                s.push(("error", str(e)))
            else:
                ok.append(s)
        if not ok:
            return
        for s in ok:
            self._live[id(s.request)] = (s, gen)
        t0 = time.perf_counter()
        try:
            done = gen.engine.add([s.request for s in ok])
        except Exception as e:  # engine state untouched by a failed prefill of this batch
            log.exception("prefill failed")
            for s in ok:
                self._live.pop(id(s.request), None)
                self.metrics.finished("error")
                s.push(("error", f"prefill failed: {type(e).__name__}: {e}"))
            return
        self.metrics.prefill(time.perf_counter() - t0)
        self._publish(gen.engine.rows + done, done)

    def _step(self, gen: _Generation) -> None:
        rows = list(gen.engine.rows)
        k = gen.controller.choose(len(rows))
        gen.note(len(rows), k)
        hybrid = isinstance(gen.proposer, HybridProposer)
        if hybrid:  # each source drafts what the controller measured it worth
            k_look = gen.controller.choose_lookup(len(rows), k)
            gen.proposer.draft_len, gen.proposer.lookup_len = k - 1, k_look - 1
            k = max(k, k_look)
        try:
            done = gen.engine.step(k)
        except Exception as e:
            log.exception("engine step failed; failing its %d rows and starting a fresh engine", len(rows))
            self._fail_generation(gen, f"engine step failed: {type(e).__name__}: {e}")
            return
        cycle = gen.engine.last_cycle  # the block it really ran (the engine may shrink it) and its times
        k_run, draft_s, rest_s = cycle.k, cycle.draft_s, cycle.verify_s + cycle.overhead_s
        accepted = [r.stats.accepted[-1] for r in rows]
        drafted = gen.proposer.last if hybrid else None
        gen.controller.observe(len(rows), k_run, accepted, draft_s, rest_s, drafted,
                               gen.proposer.last_matched if hybrid else None)
        self.metrics.cycle(len(rows), k_run, accepted, draft_s, rest_s, gen.controller.expected_speedup, drafted)
        for r in rows:
            owner = self._live.get(id(r.request))
            if owner is not None:
                owner[0].drafted += k_run - 1
                owner[0].max_rows = max(owner[0].max_rows, len(rows))
        self._publish(rows, done)

    def _publish(self, rows, done) -> None:
        """Push new tokens of ``rows`` and close the streams of ``done``."""
        for r in rows:
            owner = self._live.get(id(r.request))
            if owner is None:
                continue
            stream = owner[0]
            new = r.tokens[stream.sent:]
            if new:
                stream.sent = len(r.tokens)
                self.metrics.emitted(len(new))
                stream.push(("tokens", list(new)))
        for r in done:
            owner = self._live.pop(id(r.request), None)
            if owner is None:
                continue
            stream = owner[0]
            self.metrics.finished(r.finish_reason or "stop")
            stream.push(("done", r.finish_reason or "stop", _request_stats(r, stream)))

    def _cancel_live(self, stream: Stream, reason: str) -> None:
        owner = self._live.pop(id(stream.request), None)
        if owner is None:
            return
        result = owner[1].engine.cancel(stream.request)
        self.metrics.finished(reason)
        stream.push(("done", reason, _request_stats(result, stream) if result is not None else {}))

    def _fail_generation(self, gen: _Generation, message: str) -> None:
        for r in gen.engine.rows:
            owner = self._live.pop(id(r.request), None)
            if owner is not None:
                self.metrics.finished("error")
                owner[0].push(("error", message))
        fresh = _Generation(self.target, gen.drafter, gen.version, self.mode, gen.controller.cost, self.seed,
                            gen.lookup_block)
        self._gens = [fresh if g is gen else g for g in self._gens]


def _request_stats(result, stream: Stream) -> dict:
    s = result.stats
    return {"cycles": s.cycles, "accepted": list(s.accepted), "drafted": stream.drafted,
            "max_batch_rows": stream.max_rows, "prefill_s": s.prefill_s, "draft_s": s.draft_s, "verify_s": s.verify_s}
