"""What the load generator measures, per client class, and how it reports it."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Literal

ClientClass = Literal["healthy", "slow", "stalled"]
CLIENT_CLASSES: tuple[ClientClass, ...] = ("healthy", "slow", "stalled")
Outcome = Literal["finished", "cancelled", "reset", "error", "stalled", "incomplete"]
MAX_ERROR_SAMPLES = 5


def percentile(values: list[float], fraction: float) -> float | None:
    """Linear interpolation between the closest ranks; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = fraction * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Percentiles:
    p50: float | None
    p99: float | None
    count: int

    @classmethod
    def of(cls, values: list[float]) -> Percentiles:
        return cls(percentile(values, 0.5), percentile(values, 0.99), len(values))


@dataclass
class RequestRecord:
    """One request's progress; its client sets `outcome` as it learns more. `tokens` is how
    many it read; a stalling client's `stopped_at` is when it stopped reading (None: it did
    not), `stopped_tokens` what it had read by then, `resumed` whether it came back."""

    started: float
    request_id: str = ""
    outcome: Outcome = "incomplete"
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    error: str = ""
    tokens: int = 0
    stopped_at: float | None = None
    stopped_tokens: int = 0
    resumed: bool = False


class ClassStats:
    """Accumulates one client class's measurements.

    Owned by the event loop that runs the clients (no locks): clients call `begin`, `token` and
    `end`; the runner reads `report` at any time. Every begun request is ended exactly once;
    `records` keeps each (its id, the tokens its client read, when it stopped reading).
    """

    def __init__(self, name: ClientClass, clients: int) -> None:
        self.name = name
        self.clients = clients
        self.requests = 0
        self.tokens = 0
        self.outcomes: Counter[str] = Counter()
        self.ttft_seconds: list[float] = []
        self.ttft_censored = 0
        self.itl_seconds: list[float] = []
        self.reset_after_seconds: list[float] = []
        self.errors: list[str] = []
        self.records: list[RequestRecord] = []

    def begin(self, now: float, request_id: str = "") -> RequestRecord:
        self.requests += 1
        record = RequestRecord(started=now, request_id=request_id)
        self.records.append(record)
        return record

    def token(self, record: RequestRecord, now: float) -> None:
        self.tokens += 1
        record.tokens += 1
        if record.last_token_at is None:
            record.first_token_at = now
            self.ttft_seconds.append(now - record.started)
        else:
            self.itl_seconds.append(now - record.last_token_at)
        record.last_token_at = now

    def end(self, record: RequestRecord, now: float) -> None:
        self.outcomes[record.outcome] += 1
        if record.outcome == "incomplete" and record.first_token_at is None:
            # Still waiting at the end of the run: its TTFT is at least this long.
            self.ttft_seconds.append(now - record.started)
            self.ttft_censored += 1
        elif record.outcome == "reset":
            self.reset_after_seconds.append(now - record.started)
        elif record.outcome == "error":
            self._sample_error(record.error)

    def _sample_error(self, message: str) -> None:
        """Keeps the first few distinct error messages for the report."""
        if len(self.errors) < MAX_ERROR_SAMPLES and message not in self.errors:
            self.errors.append(message)

    def report(self, elapsed_seconds: float) -> ClassReport:
        ended = sum(self.outcomes.values())
        return ClassReport(
            clients=self.clients,
            requests=self.requests,
            in_flight=self.requests - ended,
            finished=self.outcomes["finished"],
            cancelled=self.outcomes["cancelled"],
            reset=self.outcomes["reset"],
            error=self.outcomes["error"],
            stalled=self.outcomes["stalled"],
            incomplete=self.outcomes["incomplete"],
            tokens=self.tokens,
            tokens_per_second=self.tokens / elapsed_seconds if elapsed_seconds > 0 else 0.0,
            ttft_seconds=Percentiles.of(self.ttft_seconds),
            ttft_censored=self.ttft_censored,
            itl_seconds=Percentiles.of(self.itl_seconds),
            reset_after_seconds=Percentiles.of(self.reset_after_seconds),
            errors=tuple(self.errors),
        )


@dataclass(frozen=True)
class ClassReport:
    """One class's totals. `ttft_seconds` includes, as lower bounds, the requests still waiting
    for their first token when the run ended (`ttft_censored` of them)."""

    clients: int
    requests: int
    in_flight: int
    finished: int
    cancelled: int
    reset: int
    error: int
    stalled: int
    incomplete: int
    tokens: int
    tokens_per_second: float
    ttft_seconds: Percentiles
    ttft_censored: int
    itl_seconds: Percentiles
    reset_after_seconds: Percentiles
    errors: tuple[str, ...]


@dataclass(frozen=True)
class LoadReport:
    url: str
    endpoint: str
    model: str
    duration_seconds: float
    classes: dict[ClientClass, ClassReport]

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        for report in body["classes"].values():
            report["errors"] = list(report["errors"])
        return body

    @property
    def total_tokens(self) -> int:
        return sum(report.tokens for report in self.classes.values())

    @property
    def total_errors(self) -> int:
        return sum(report.error for report in self.classes.values())


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


_COLUMNS = (
    "class   clients requests finished cancelled reset error stalled incompl. tok/s"
    "  TTFTp50 TTFTp99  ITLp50  ITLp99 (ms)"
)


def render_text(report: LoadReport) -> str:
    """A small table for humans, one row per client class that had clients."""
    lines = [
        f"kvwatch loadgen: {report.duration_seconds:.1f} s against {report.url} "
        f"(model {report.model})",
        _COLUMNS,
    ]
    for name, row in report.classes.items():
        if not row.clients:
            continue
        lines.append(
            f"{name:<8}{row.clients:>7}{row.requests:>9}{row.finished:>9}{row.cancelled:>10}"
            f"{row.reset:>6}{row.error:>6}{row.stalled:>8}{row.incomplete:>9}"
            f"{row.tokens_per_second:>6.1f}{_ms(row.ttft_seconds.p50):>9}"
            f"{_ms(row.ttft_seconds.p99):>8}{_ms(row.itl_seconds.p50):>8}"
            f"{_ms(row.itl_seconds.p99):>8}"
        )
        lines += [f"  {name} error: {message}" for message in row.errors]
    return "\n".join(lines)


def progress_line(report: LoadReport, elapsed_seconds: float, duration_seconds: float) -> str:
    parts = [f"loadgen {elapsed_seconds:4.1f}/{duration_seconds:g} s"]
    for name, row in report.classes.items():
        if row.clients:
            parts.append(
                f"{name}: {row.finished} done {row.reset} reset {row.error} err "
                f"{row.tokens_per_second:.0f} tok/s"
            )
    return "  ".join(parts)
