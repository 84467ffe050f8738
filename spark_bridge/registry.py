"""Which data endpoint each worker of the job serves, as worker 0's coordinator learns it.

Workers 1..N-1 register (``hello``) with the job's identity (:func:`job_identity`): the first
registration of each worker of this job counts, and any other is refused, so that a second launch
of the job on the same coordinator endpoint cannot redirect the running job's writes and reads.
"""
from __future__ import annotations

import hashlib
from typing import Any

Entry = tuple[str, str]  # (data endpoint, the worker's bridge generation)


def job_identity(worker: Any) -> str | None:
    """What every worker of one run of a job shares and another run does not (a digest of the job
    token), or ``None`` for a worker without one (a single in-process worker registers with nobody)."""
    ident = getattr(worker, "job_id", None)  # timely.Worker.job_id (a stand-in worker may lack it)
    return None if ident is None else hashlib.sha256(b"spark-bridge/" + str(ident).encode()).hexdigest()[:32]


class Registry:
    """The data endpoints of a job's ``peers`` workers, by index."""

    def __init__(self, peers: int, job: str | None, index: int, own: Entry) -> None:
        self.peers = peers
        self.job = job
        self.endpoints: dict[int, Entry] = {index: own}

    @property
    def complete(self) -> bool:
        """Every worker registered."""
        return len(self.endpoints) == self.peers

    def register(self, req: dict) -> str | None:
        """Apply a checked ``hello`` request; why it is refused, or None once registered."""
        w, entry = req["worker"], (req["endpoint"], req["generation"])
        if req.get("job") != self.job:
            return "it belongs to another job (was the job launched twice on this endpoint?)"
        if not 0 < w < self.peers:
            return f"this job's workers 1..{self.peers - 1} register, not {w}"
        if self.endpoints.get(w, entry) != entry:
            return f"worker {w} is registered already, at {self.endpoints[w][0]}"
        self.endpoints[w] = entry
        return None

    def plan(self) -> list[list[str]]:
        """``[data endpoint, generation]`` of every worker (all registered)."""
        return [list(self.endpoints[i]) for i in range(self.peers)]

    def generations(self) -> list[str | None]:
        """The bridge generation of every worker, ``None`` where not registered yet."""
        return [self.endpoints[i][1] if i in self.endpoints else None for i in range(self.peers)]

    def known(self) -> list[str | None]:
        """The data endpoint of every worker, ``None`` where not registered yet."""
        return [self.endpoints[i][0] if i in self.endpoints else None for i in range(self.peers)]
