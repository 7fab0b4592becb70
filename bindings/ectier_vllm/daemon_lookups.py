"""The daemon-mode scheduler's lookups: one ``prefetch`` request per scheduler step, never waited
for beyond a small bound (:class:`StepLookups`), and the handles the connector polls
(:class:`DaemonLoad`).

How a step asks (issue 14: "the scheduler never waits on I/O"):

- A step never connects: without a connection it starts one attempt in a background thread
  (:meth:`~ectier.daemon.client_conn.Transport.connect_in_background`); its keys are
  ``"pending"`` while the attempt runs and a miss (``DaemonUnavailableError``) once it failed,
  until a later attempt succeeds (one per back-off window).
- The first question of a step about a key nobody asked yet sends **one** ``prefetch`` request for
  every key the step expects (:meth:`StepLookups.expect`) and every promotion still in flight,
  with ``pin`` for the daemon to pin (process-held) those that are ready, and returns without
  waiting for the reply (:meth:`~ectier.daemon.client_conn.Transport.submit`).
- The reply is read when it has arrived: the socket is read (one non-blocking read, no poll) at
  the step's first question it cannot answer and when the step ends, and waited on within the
  step's wait budget (``daemon_answer_wait_s``, shared by all questions of the step); the other
  questions of the step cost no system call. A key whose answer is not in
  yet is ``"pending"`` for now: the request waits for a later step (vLLM asks again).
- An answer, a miss included, holds for the rest of the step it is used in (a miss is asked once
  per step); an answer that arrives after its question holds for the next step, then goes (its
  pin, never acquired, is released).
- Releases of the scheduler's pins are queued and sent in one ``release`` request
  (:meth:`StepLookups.send_releases`, also without waiting for its reply), so no background thread
  wakes for them; one whose request was lost goes to the background releaser, which retries.
- A producer's scheduler that confirms saves itself (:mod:`ectier_vllm.confirm`) asks ``contains``
  the same way (:class:`StoredQueries`): sent without waiting, the reply read in a later step.

Errors are ectier's (``EctierError``: ``DaemonUnavailableError`` when the daemon is unreachable,
hung past ``daemon_timeout_s`` or lost); the connector turns them into misses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from .store import Pin

log = logging.getLogger("vllm.ectier." + __name__.rsplit(".", 1)[-1])  # (under vLLM's logger: common.py)

ABSENT, READY, PROMOTING = "absent", "ready", "promoting"
#: not answered yet (no reply in, or no connection yet): a wait, and nothing known of the key
PENDING = "pending"


@dataclass
class _Ask:
    """The step's ``prefetch`` request in flight: its id, keys, keys to pin, the daemon run."""

    rid: int
    batch: list  # the keys, in the order of the reply's states
    keys: frozenset
    pin: list | None
    instance: str


class StepLookups:
    """The step-batched, non-blocking lookups of one daemon client (module docstring).

    Args:
        client: the connector's :class:`~ectier.daemon.client.DaemonClient`.
        namespace: sent with every request.
        wait_s: the step's wait budget for replies, seconds (``daemon_answer_wait_s``).
        make_pin: ``(get-reply fields, daemon instance) -> Pin`` of a process-held pin.
    """

    def __init__(self, client: Any, namespace: str, wait_s: float, make_pin: Callable[[dict, str], Pin]) -> None:
        self.client = client
        self.namespace = namespace
        self.wait_s = wait_s
        self._make_pin = make_pin
        self.step = 0
        self._answers: dict[str, str] = {}  # answers used in this step: key -> state
        self._fresh: dict[str, tuple[str, int]] = {}  # received, not used yet: key -> (state, step received)
        self._pinned: dict[str, tuple[Pin, int]] = {}  # pins received, not acquired: key -> (pin, step)
        self._queued: dict[str, None] = {}  # keys to ask in the next request (an ordered set)
        self.tracked: dict[str, int] = {}  # key of a handle in flight -> step it was last polled
        self._ask: _Ask | None = None
        self._wait_left = wait_s
        self._read = False  # the socket was read this step without waiting (once per step)
        self._sent_at = -1  # the last step whose questions sent a prefetch request
        self._releases: dict[str, list[int]] = {}  # daemon instance -> lease ids to release
        self._release_asks: dict[int, tuple[str, list[int]]] = {}  # release request id -> its ids
        #: requests sent (``prefetch``, ``release``), for tests and diagnostics
        self.sent = {"prefetch": 0, "release": 0}

    # ------------------------------------------------------------------------ the step
    def new_step(self) -> None:
        """A scheduler step begins (never raises, never waits): answers used in the last step are
        forgotten, pins nobody acquired are released, queued releases are sent; promotions still
        in flight are asked again at once when the step that ends sent no request."""
        self._collect_quietly()
        self.step += 1
        self._wait_left = self.wait_s
        self._read = False
        for key, (pin, step) in list(self._pinned.items()):
            if key in self._answers or step < self.step - 1:  # asked and not pinned, or stale
                del self._pinned[key]
                self.release_later(pin.lease)
        self._answers = {}
        self._fresh = {k: v for k, v in self._fresh.items() if v[1] >= self.step - 1}
        self._queued = {}  # a request still waiting says so again
        # handles nobody polled in the last step (promotion given up by the connector): not asked again
        self.tracked = {k: s for k, s in self.tracked.items() if s >= self.step - 1}
        if self._ask is None and self._sent_at < self.step - 1 and self.tracked:
            # promotions answered "promoting" in a step that sent nothing: the next step's one
            # request goes now, so its answer can arrive during the model step
            try:
                self._send(early=True)
            except Exception as exc:  # noqa: BLE001 - asked again by the next question (a miss there)
                log.debug("ectier: asking the daemon about promotions in flight failed: %s", exc)
        self.send_releases()

    def expect(self, keys: list[str]) -> None:
        """Keys the scheduler is about to ask about this step: asked in the same request."""
        for key in keys:
            if key not in self._answers and key not in self._fresh:
                self._queued[key] = None

    def answer(self, key: str) -> str:
        """This step's state of ``key``: ``"absent"``, ``"ready"`` (pinned when it was asked with
        a pin), ``"promoting"`` (the daemon promotes it) or ``"pending"`` (its answer is not in
        yet). Waits at most what is left of the step's wait budget.

        Raises:
            EctierError (DaemonUnavailableError, ...): the request could not be sent, or was lost,
            or the daemon left it unanswered past ``daemon_timeout_s``.
        """
        state = self._answers.get(key)
        if state is not None:
            return state
        if key not in self._fresh and not self._read:
            self._read = True  # the other questions of the step read nothing more without a wait
            self._collect(0.0)
        if key not in self._fresh:
            if self._ask is None or key not in self._ask.keys:
                self._queued[key] = None
                if self._ask is None:
                    self._send()
            if self._wait_left > 0 and self._ask is not None and key in self._ask.keys:
                t0 = time.perf_counter()
                try:
                    self._collect(self._wait_left)
                finally:
                    self._wait_left -= time.perf_counter() - t0
        got = self._fresh.pop(key, None)
        if got is None:
            return PENDING  # not answered yet: not remembered, the next question may find it
        self._answers[key] = got[0]
        return got[0]

    def answered(self, key: str) -> str | None:
        """This step's answer about ``key`` if it was used already (``"absent"`` or ``"ready"``;
        else None): no question, no I/O."""
        state = self._answers.get(key)
        return None if state == PROMOTING else state

    def forget(self, key: str) -> None:
        """Let the next question about ``key`` ask again (a wait, not a step)."""
        self._answers.pop(key, None)
        self._read = False

    def take_pin(self, key: str) -> Pin | None:
        """The pin the daemon took for ``key`` in a reply (None: none), now the caller's."""
        got = self._pinned.pop(key, None)
        return None if got is None else got[0]

    # ------------------------------------------------------------------------ requests
    def _send(self, early: bool = False) -> None:
        """Send the step's one ``prefetch`` request (``early``: the next step's, sent as this one
        ends: it does not count as this step's)."""
        from ectier.daemon.protocol import MAX_BATCH_KEYS
        from ectier.entry import validate_key

        stale = [k for k in self.tracked if k not in self._answers and k not in self._fresh]
        batch = list(dict.fromkeys([*self._queued, *stale]))[:MAX_BATCH_KEYS]
        for key in batch:
            validate_key(key)
        if not self.client.connect_in_background():  # a scheduler step never waits on a connect
            if self.client.connecting:
                return  # asked again next step ("pending" meanwhile)
            raise self.unreachable_error()
        features = self.client.features
        args: dict[str, Any] = {"keys": batch, "namespace": self.namespace}
        if "direct" in features:
            args["direct"] = True
        pin = [k for k in batch if k not in self._pinned] if "view" in features else None
        if pin is not None:
            args["pin"] = pin
        rid = self.client.submit("prefetch", connect=False, **args)
        self.sent["prefetch"] += 1
        if not early:
            self._sent_at = self.step
        self._ask = _Ask(rid, batch, frozenset(batch), pin, self.client.server_info.get("instance", ""))
        for key in batch:
            self._queued.pop(key, None)

    def unreachable_error(self) -> Exception:
        """The error of a question asked while the daemon is unreachable (a miss this step)."""
        from ectier.daemon.client import DaemonUnavailableError

        return DaemonUnavailableError(f"the ectier daemon at {self.client.socket_path!r} is not connected "
                                      "(unreachable: one attempt in the background per back-off window)")

    def _collect(self, timeout: float) -> None:
        """Take the replies that arrived (waiting at most ``timeout`` for the step's request).
        Raises as :meth:`answer` for the ``prefetch`` request (it is then forgotten)."""
        ask = self._ask
        if ask is None:
            if self._release_asks and self.client.answered(next(iter(self._release_asks))):
                self._collect_releases()
            return
        try:
            reply = self.client.poll(ask.rid, timeout)  # reads every reply that has arrived
        except BaseException:
            self._ask = None
            raise
        finally:
            self._collect_releases()
        if reply is None:
            return
        self._ask = None
        for key, state in zip(ask.batch, reply["states"]):
            self._fresh[key] = (state, self.step)
        for key, fields in zip(ask.pin or (), reply.get("pins") or ()):
            if fields is not None:
                self._pinned[key] = (self._make_pin(fields, ask.instance), self.step)

    def _collect_quietly(self) -> None:
        try:
            self._collect(0.0)
        except Exception as exc:  # noqa: BLE001 - the keys are asked again (and fail there, a miss)
            log.debug("ectier: the daemon's answer to a lookup was lost: %s", exc)

    # ------------------------------------------------------------------------ releases
    def release_later(self, lease: Any) -> None:
        """Queue the release of process-held lease ``lease`` (a ``HeldLease``): sent by the next
        :meth:`send_releases` (never blocks)."""
        self._releases.setdefault(lease.instance, []).append(lease.id)

    def release_held(self, lease_id: int, instance: str) -> None:
        """The ``DaemonClient.release_held`` signature of :meth:`release_later` (scheduler thread only)."""
        self._releases.setdefault(instance, []).append(lease_id)

    def send_releases(self) -> None:
        """Send the queued releases, one ``release`` request per daemon run, without waiting
        for the reply; what cannot be sent goes to the background releaser (it retries)."""
        from ectier.daemon.protocol import MAX_BATCH_KEYS

        queued, self._releases = self._releases, {}
        connected = not queued or self.client.connect_in_background()
        for instance, ids in queued.items():
            if not connected:  # never a connect in the step: the background releaser sends them
                self._to_background(instance, ids)
                continue
            for i in range(0, len(ids), MAX_BATCH_KEYS):
                chunk = ids[i:i + MAX_BATCH_KEYS]
                try:
                    rid = self.client.submit("release", connect=False, leases=chunk, instance=instance)
                except Exception:  # noqa: BLE001 - unreachable: the background releaser retries
                    self._to_background(instance, chunk)
                    continue
                self.sent["release"] += 1
                self._release_asks[rid] = (instance, chunk)

    def _collect_releases(self) -> None:
        for rid, (instance, ids) in list(self._release_asks.items()):
            try:
                if not self.client.answered(rid) or self.client.poll(rid, 0.0) is None:
                    continue
            except Exception:  # noqa: BLE001 - lost before the daemon answered: maybe not done
                self._to_background(instance, ids)
            del self._release_asks[rid]

    def _to_background(self, instance: str, ids: list[int]) -> None:
        for lease_id in ids:
            self.client.release_held(lease_id, instance)

    @property
    def releases_pending(self) -> int:
        """Lease ids queued or sent whose release the daemon did not confirm yet."""
        return sum(map(len, self._releases.values())) + sum(len(ids) for _, ids in self._release_asks.values())

    def close(self) -> None:
        """Release every pin not acquired, send the queued releases, wait briefly (at most 1 s)
        for their replies; the rest goes to the background releaser."""
        for pin, _ in self._pinned.values():
            self.release_later(pin.lease)
        self._pinned = {}
        self.send_releases()
        deadline = time.monotonic() + 1.0
        for rid, (instance, ids) in self._release_asks.items():
            try:
                if self.client.poll(rid, max(0.0, deadline - time.monotonic())) is not None:
                    continue
            except Exception:  # noqa: BLE001 - lost: maybe not done
                pass
            self._to_background(instance, ids)
        self._release_asks = {}


#: ``contains`` requests of :class:`StoredQueries` in flight at most (a hung daemon never fills the
#: socket's send buffer, whose overflow ``submit`` would wait on)
MAX_STORED_IN_FLIGHT = 256


class StoredQueries:
    """The daemon's ``contains``, asked without waiting (the save confirmation of a producer's
    scheduler, :mod:`ectier_vllm.confirm`): :meth:`ask` sends a request per key not asked yet and
    returns the answers that have arrived; nothing here connects, waits or raises."""

    def __init__(self, client: Any, namespace: str) -> None:
        self.client = client
        self.namespace = namespace
        self._asks: dict[str, int] = {}  # key -> id of its contains request in flight

    def ask(self, keys: list[str]) -> dict[str, bool | None]:
        """Per key of ``keys``: True (the daemon stores it) or False (it does not, or the question
        was lost: the daemon is down, unreachable, or left it unanswered past ``daemon_timeout_s``)
        once the answer is in; None while it is not (asked now unless asked already)."""
        client = self.client
        connected = client.connect_in_background()  # reads what has arrived; never waits
        out: dict[str, bool | None] = {}
        for key in keys:
            rid = self._asks.get(key)
            if rid is not None:
                out[key] = self._take(key, rid)
            elif not connected:
                out[key] = None if client.connecting else False
            elif len(self._asks) >= MAX_STORED_IN_FLIGHT:
                out[key] = None
            else:
                try:
                    self._asks[key] = client.submit("contains", connect=False, key=key, namespace=self.namespace)
                except Exception:  # noqa: BLE001 - not sent (unreachable, a bad key): not known to be there
                    out[key] = False
                else:
                    out[key] = None
        for key in [k for k in self._asks if k not in out]:  # asked for, no longer wanted
            self._take(key, self._asks[key])
        return out

    def _take(self, key: str, rid: int) -> bool | None:
        """The answer to ``key``'s request ``rid`` if it is in (forgetting the request), else None."""
        if not self.client.answered(rid):  # no I/O
            return None
        del self._asks[key]
        try:
            reply = self.client.poll(rid, 0.0)
        except Exception:  # noqa: BLE001 - lost or hung past daemon_timeout_s
            return False
        return None if reply is None else bool(reply.get("found"))


class DaemonLoad:
    """A daemon promotion of one key, as the connector polls it (the shape of ectier's
    ``LoadHandle``): ``done()`` is True once the daemon answered ``ready`` or ``absent`` (asked at
    most once per scheduler step, see :class:`StepLookups`), or the question failed (``error``:
    the exception); ``wait(timeout_s)`` is True for ``ready``. ``done()`` never waits beyond the
    step's wait budget; ``wait`` with a timeout above 0 asks again every 10 ms until then."""

    __slots__ = ("key", "error", "_lookups", "_state")

    def __init__(self, lookups: StepLookups, key: str, state: str | None = None) -> None:
        self.key = key
        self.error: BaseException | None = None
        self._lookups = lookups
        # ``state``: this step's answer, asked by the caller (else the one used this step, if any)
        self._state = lookups.answered(key) if state is None else state
        if self._state not in (READY, ABSENT):  # not done: tracked, asked again while polled
            lookups.tracked[key] = lookups.step

    def done(self) -> bool:
        if self.error is not None or self._state in (READY, ABSENT):
            return True
        self._lookups.tracked[self.key] = self._lookups.step
        try:
            self._state = self._lookups.answer(self.key)
        except Exception as exc:  # noqa: BLE001 - a handle reports, never raises (the item is a miss)
            self.error = exc
        finished = self.error is not None or self._state in (READY, ABSENT)
        if finished:
            self._lookups.tracked.pop(self.key, None)
        return finished

    @property
    def pending(self) -> bool:
        """True while the daemon has not answered about the key (unasked, or no reply in yet):
        nothing is known of where it lies, so no load-or-recompute estimate applies."""
        return self.error is None and self._state in (None, PENDING)

    def wait(self, timeout_s: float | None = None) -> bool:
        deadline = None
        while not self.done():
            if deadline is None and timeout_s is not None:
                deadline = time.monotonic() + timeout_s  # (no clock read for a handle done already)
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
            self._lookups.forget(self.key)  # ask again: this is a wait, not a step
        return self.error is None and self._state == READY

    def __repr__(self) -> str:
        return f"<DaemonLoad {self.key!r} {self._state or 'unasked'}>"
