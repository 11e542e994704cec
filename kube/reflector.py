"""`Reflector`: the one list+watch loop, in a thread of its own (slice publisher, claim cache).

It lists, then watches from the list's resourceVersion; a stream that ends or breaks resumes from
the last event's (or BOOKMARK's) version, 410 Gone lists again, and failures back off
exponentially. A pass that ran `MIN_HEALTHY_WATCH_S` or longer resumes at once. The callbacks run
in the reflector's thread. A thread, not an asyncio task: a watch blocks for minutes, and a thread
of its own keeps it out of an event loop's default executor.
See docs/architecture.md#list-and-watch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Generic, Protocol, TypeVar

from gpu_dra.kube import errors

log = logging.getLogger(__name__)

MIN_HEALTHY_WATCH_S: Final = 5.0
"""A list+watch pass that ran this long resumes at once when it ends; a shorter one backs off."""


class Versioned(Protocol):
    """A list or an event: where a watch continues from after it."""

    @property
    def resource_version(self) -> str: ...


ListT = TypeVar("ListT", bound=Versioned)
EventT = TypeVar("EventT", bound=Versioned)
EventT_co = TypeVar("EventT_co", bound=Versioned, covariant=True)


class Watch(Protocol[EventT_co]):
    """One watch stream. `close` may be called from another thread to unblock `next_event`."""

    def next_event(self) -> EventT_co | None:
        """The next event; None when the stream ended. Raises `errors.ApiError` subclasses
        (`ResourceExpiredError`: 410 Gone)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ReflectorSettings:
    """Timing of the list and watch."""

    backoff_initial_s: float = 0.2
    """First wait after a failed (or too short) pass; doubled per failure in a row."""
    backoff_max_s: float = 30.0
    """Longest wait between passes."""
    watch_timeout_s: int = 300
    """Server-side timeout of one watch request; the watch then resumes where it stopped."""
    close_timeout_s: float = 15.0
    """How long `close()` waits for the thread (a list in flight ends with its request timeout)."""

    def __post_init__(self) -> None:
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.watch_timeout_s <= 0:
            raise ValueError("watch_timeout_s must be positive")


class Reflector(Generic[ListT, EventT]):
    """Lists and watches one kind of object until `stop()`, feeding the callbacks.

    `list_objects()` returns a consistent snapshot; `watch(resource_version, timeout_seconds)` opens
    a stream. `on_list` gets each snapshot, `on_event` each event (BOOKMARKs included);
    `on_watching(True)` is called when a stream is open, `on_watching(False)` when it ended. `what`
    names the objects in logs ("ResourceClaims").
    """

    def __init__(
        self,
        what: str,
        list_objects: Callable[[], ListT],
        watch: Callable[[str, int], Watch[EventT]],
        on_list: Callable[[ListT], None],
        on_event: Callable[[EventT], None],
        *,
        on_watching: Callable[[bool], None] | None = None,
        settings: ReflectorSettings | None = None,
    ) -> None:
        self._what = what
        self._list = list_objects
        self._open_watch = watch
        self._on_list = on_list
        self._on_event = on_event
        self._on_watching = on_watching or (lambda _open: None)
        self.settings = settings or ReflectorSettings()
        self._lock = threading.Lock()
        self._watch: Watch[EventT] | None = None  # guarded by _lock
        self._resource_version: str | None = None  # owned by the thread; None: list first
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, thread_name: str) -> None:
        """Start listing and watching in a daemon thread. Once."""
        if self._thread is not None:
            raise RuntimeError(f"the {self._what} reflector is already started")
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Make the thread end soon: closes the open watch, ends a backoff wait at once. Any
        thread; idempotent; final. Does not wait (`join`)."""
        self._stopping.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            with contextlib.suppress(Exception):
                watch.close()

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the thread; whether it has ended (or never started)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def close(self) -> None:
        """`stop()`, then wait up to `close_timeout_s` for the thread (a list or watch request in
        flight cannot be interrupted; it ends with its request timeout)."""
        self.stop()
        if not self.join(self.settings.close_timeout_s):
            log.warning(
                "%s list/watch thread still running after %.0f s (a request in flight); "
                "it ends with the request",
                self._what,
                self.settings.close_timeout_s,
            )

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        settings = self.settings
        delay = settings.backoff_initial_s
        while not self._stopping.is_set():
            started = time.monotonic()
            problem: str | None = None
            try:
                if self._resource_version is None:
                    self._relist()
                self._watch_once()
            except errors.ResourceExpiredError:
                log.info("%s watch expired (410 Gone); listing again", self._what)
                self._resource_version = None
            except errors.ApiError as error:
                problem = str(error)
            except Exception as error:  # a bug: log it, start over from a list
                log.exception("listing/watching %s failed; listing again", self._what)
                problem = repr(error)
                self._resource_version = None
            if time.monotonic() - started >= MIN_HEALTHY_WATCH_S:
                delay = settings.backoff_initial_s  # it ran a while: resume (or list) at once
                pause = delay if problem else 0.0
            else:  # failed or ended at once: back off, so that a repeating failure is no busy loop
                pause, delay = delay, min(delay * 2, settings.backoff_max_s)
            if problem is not None and not self._stopping.is_set():
                log.warning(
                    "listing/watching %s failed: retry_in_s=%.2f error=%s",
                    self._what,
                    pause,
                    problem,
                )
            if self._stopping.wait(pause):
                break
        log.info("%s list/watch stopped", self._what)

    def _relist(self) -> None:
        listing = self._list()
        self._on_list(listing)
        self._resource_version = listing.resource_version

    def _watch_once(self) -> None:
        """Follow one watch stream, keeping `_resource_version` at the last event handled."""
        assert self._resource_version is not None
        if self._stopping.is_set():
            return
        watch = self._open_watch(self._resource_version, self.settings.watch_timeout_s)
        with self._lock:
            if self._stopping.is_set():  # stop() ran before it could see this watch
                watch.close()
                return
            self._watch = watch
        try:
            self._on_watching(True)
            while (event := watch.next_event()) is not None:
                self._on_event(event)
                self._resource_version = event.resource_version or self._resource_version
        finally:
            self._on_watching(False)
            with self._lock:
                self._watch = None
            watch.close()
