"""What one pass observed about a pair's release, as values: the input of plan/release_plan.py (nothing
changes them; release_plan.py reads, the replay tests build new ones).

Everything here is read before anything is decided (reads.py reads it from MLflow and the
API server), so every decision about gating and promotion is a function of these values and is
tested as a table without servers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from specpair_operator.gate import attempts as gate_attempts

if TYPE_CHECKING:
    from specpair_operator.observe.serving_world import Installation   # it imports this module


@dataclass(frozen=True)
class GateJob:
    """One attempt's gate Job and what its pods reported."""
    name: str
    owned: bool = True
    failed: bool = False          # its Failed condition is True
    failure_message: str = ""     # the Job's own words for that
    failed_at: str = ""           # when (RFC 3339)
    complete: bool = False        # its Complete condition is True
    started_at: str = ""
    completed_at: str = ""
    # The termination messages of its pods' containers: the runner's report (the verdict's
    # digest, or why there is none).
    reports: tuple[str, ...] = ()

    @property
    def finished(self) -> bool:
        return self.failed or self.complete

    def verdict_digest(self, version: str) -> str | None:
        """The digest of the verdict this attempt's gate reported for `version`, if any."""
        for text in self.reports:
            try:
                report = json.loads(text)
            except ValueError:
                continue
            if isinstance(report, dict) and str(report.get("version")) == str(version) \
                    and isinstance(report.get("verdictSha256"), str):
                return report["verdictSha256"]
        return None

    def failure(self, version: str) -> gate_attempts.Failure:
        return gate_attempts.failure_of(list(self.reports), version, self.failure_message)


@dataclass(frozen=True)
class Records:
    """What the status says was recorded (history entries, and per action the keys of the last
    ones), so a step redone after a crash records once."""
    recorded: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    has_recorded: bool = True      # a status written before `recorded` existed has none
    history: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> "Records":
        recorded = {k: tuple(v) for k, v in (status.get("recorded") or {}).items() if isinstance(v, list)}
        return cls(recorded, "recorded" in status, tuple(status.get("history") or ()))

    def was(self, action: str, key: str, version: str) -> bool:
        if self.has_recorded:
            return key in self.recorded.get(action, ())
        last = next((h for h in reversed(self.history) if h.get("action") == action), None)
        return last is not None and str(last.get("toVersion")) == str(version)


@dataclass(frozen=True)
class ReleaseWorld:
    """The spec's release and its gate as one pass found them."""
    pair: str
    namespace: str
    version: str                   # the model version of the spec's release
    digest: str                    # its content hash
    thresholds: Mapping[str, Any]
    aliases: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)  # the version's tags
    gate_status: str = "pending"               # pending, passed, failed or error (registry.gate_result)
    verdict: Mapping[str, Any] | None = None
    gate_message: str = ""
    gate_jobs: tuple[GateJob, ...] = ()        # one per attempt, in order
    gate_policy_owned: bool | None = None      # the gate NetworkPolicy: None when absent
    gate_pods_waiting: str = ""                # why the latest attempt's pods cannot start ('' if nothing stops them)
    verified_verdicts: Mapping[str, str] = field(default_factory=dict)  # status.verifiedVerdicts: version -> reported digest
    records: Records = field(default_factory=Records)
    attempts: gate_attempts.Policy = field(default_factory=gate_attempts.Policy)
    now: str = "1970-01-01T00:00:00Z"
    # The model cache (model_fetch.py): the release's models digest, the digests status.modelCache
    # records as fetched, and where the release's fetch Job stands (a model_fetch.FetchState;
    # None when the release needs no fetch: no claim, nothing to download, or fetched already).
    models: str = ""
    fetched: tuple[str, ...] = ()
    model_fetch: Any = None
    # How a passed candidate rolls out (rollout_strategy.py): spec.rollout, and the champion's
    # release (its specpair.release tag; None when no other champion serves or it has none).
    rollout: Mapping[str, Any] = field(default_factory=dict)
    champion_release: Mapping[str, Any] | None = None
    # What the release's fetch Job is rendered from (plan/model_cache.fetch_job): the registered
    # model, the spec's release, and the installation's settings (None: the defaults).
    model: str = ""
    release: Mapping[str, Any] | None = None
    installation: Installation | None = None
    # A version a training Job registered for a drifted category of the champion (issue 58): the
    # release plan drives it instead of the spec's release, forced through shadow scoring
    # (plan/learned_release.LearnedCandidate; None for the spec's release).
    learned: Any = None
