"""`LeaseStore`: one Lease held in memory with the apiserver's write rules (create fails when it
exists, a write with a stale resourceVersion fails with a conflict), and `LeaseClient`, one
candidate's `LeaseApi` view of it that can be cut off from the store (`down`)."""

from __future__ import annotations

import threading
from dataclasses import replace

from gpu_dra.controller import errors
from gpu_dra.controller.leader import LeaseRecord


class LeaseStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._record: LeaseRecord | None = None
        self._version = 0
        self.writes: list[LeaseRecord] = []

    @property
    def record(self) -> LeaseRecord | None:
        with self._lock:
            return self._record

    def get(self) -> LeaseRecord | None:
        with self._lock:
            return self._record

    def create(self, record: LeaseRecord) -> LeaseRecord:
        with self._lock:
            if self._record is not None:
                raise errors.AlreadyExistsError("create Lease: exists", status=409)
            return self._store(record)

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        with self._lock:
            if self._record is None:
                raise errors.NotFoundError("update Lease: not found", status=404)
            if record.resource_version != self._record.resource_version:
                raise errors.ConflictError("update Lease: stale resourceVersion", status=409)
            return self._store(record)

    def _store(self, record: LeaseRecord) -> LeaseRecord:
        self._version += 1
        self._record = replace(record, resource_version=str(self._version))
        self.writes.append(self._record)
        return self._record


class LeaseClient:
    """One candidate's connection to the store; `down` makes every call fail as a network
    error would."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise errors.ApiError("read Lease: connection refused")

    def get(self) -> LeaseRecord | None:
        self._check()
        return self.store.get()

    def create(self, record: LeaseRecord) -> LeaseRecord:
        self._check()
        return self.store.create(record)

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        self._check()
        return self.store.replace(record)
