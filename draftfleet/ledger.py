"""Fast counters and budget admission in Redis; the store stays the truth.

Counting is idempotent: one Lua script adds the key to the dataset's counted set and bumps the
totals only if it was not there, so a redelivered task, or a worker that stored a record and died
before counting it (the next copy finds the record and counts it), never counts twice. The same
script releases the key's budget reservation, so committed and reserved tokens move together.

Budget admission, in two phases. Before generating, a task reserves the dataset's expected tokens
(the running mean). (1) Tasks are admitted freely while committed + reserved + half a response
+ a safety margin (3 standard deviations of the length times the square root of what is in
flight) stays within the budget. A response still running long after admission is a long one
(short ones finish first, and lengths are heavy-tailed), so its reservation grows to twice the
tokens one stream makes in that time, up to max_tokens.
(2) Past that, closing rounds: each waits until nothing is in flight, then admits up to half of
the room left; rounds shrink until less than one response fits, and the dataset closes (its
queue is purged, later tasks are skipped). Waiting rounds have no stragglers to guess about, so
the total lands within about one response of the budget. Reservations whose claim expired (a
dead worker) are dropped on the spot.
"""

from __future__ import annotations

import time

import redis

from draftfleet import redis_keys as rk
from draftfleet.schemas.records import ResponseRecord

RATE_BUCKET_S = 10
RATE_KEEP_S = 900

_COUNT_ONCE = """
redis.call('HDEL', KEYS[5], ARGV[1])
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
for _, h in ipairs({KEYS[2], KEYS[4]}) do
  redis.call('HINCRBY', h, 'responses', 1)
  redis.call('HINCRBY', h, 'prompt_tokens', ARGV[2])
  redis.call('HINCRBY', h, 'completion_tokens', ARGV[3])
  redis.call('HINCRBY', h, 'cost_micro_usd', ARGV[4])
end
redis.call('HINCRBY', KEYS[3], 'cost_micro_usd', ARGV[4])
redis.call('HINCRBY', KEYS[4], 'latency_ms', ARGV[6])
redis.call('HINCRBY', KEYS[4], 'completion_tokens_sq', tonumber(ARGV[3]) * tonumber(ARGV[3]))
redis.call('HINCRBY', KEYS[6], 'completion_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[6], 'responses', 1)
redis.call('EXPIRE', KEYS[6], ARGV[5])
return 1
"""

_ADMIT = """
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local committed = tonumber(redis.call('HGET', KEYS[1], 'completion_tokens') or '0')
local responses = tonumber(redis.call('HGET', KEYS[1], 'responses') or '0')
local sq = tonumber(redis.call('HGET', KEYS[1], 'completion_tokens_sq') or '0')
local latency_ms = tonumber(redis.call('HGET', KEYS[1], 'latency_ms') or '0')
local per_stream = 0
if latency_ms > 0 then per_stream = committed / latency_ms end  -- tokens per ms of one stream
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local reserved, live = 0, 0
local held = redis.call('HGETALL', KEYS[2])
for i = 1, #held, 2 do
  if redis.call('EXISTS', ARGV[4] .. held[i]) == 1 then
    local e, since = string.match(held[i + 1], '(%d+):(%d+)')
    -- a response still running long after admission is a long one (lengths are heavy-tailed: the
    -- longer it has run, the longer it will run): reserve twice what it has likely made so far
    local made = per_stream * (now - tonumber(since))
    reserved = reserved + math.min(tonumber(ARGV[5]), math.max(tonumber(e), 2 * made))
    live = live + 1
  else
    redis.call('HDEL', KEYS[2], held[i])  -- its worker died: the claim expired
  end
end
local budget = tonumber(ARGV[2])
local expect = tonumber(ARGV[3])
local function take()
  redis.call('HSET', KEYS[2], ARGV[1], expect .. ':' .. now)
end
if redis.call('EXISTS', KEYS[4]) == 0 then
  local var = expect * expect
  if responses >= 5 then var = math.max(0, sq / responses - (committed / responses) ^ 2) end
  local margin = 3 * math.sqrt(var) * math.sqrt(live + 1)
  if committed + reserved + expect / 2 + margin <= budget then take() return 1 end
  redis.call('HSET', KEYS[4], 'cap', 0, 'admitted', 0)  -- closing rounds start
end
local cap = tonumber(redis.call('HGET', KEYS[4], 'cap'))
local admitted = tonumber(redis.call('HGET', KEYS[4], 'admitted'))
if live > 0 then
  if admitted + expect <= cap then
    take()
    redis.call('HINCRBY', KEYS[4], 'admitted', expect)
    return 1
  end
  return 2
end
local room = budget - committed
if room < expect then
  redis.call('SET', KEYS[3], ARGV[2])
  redis.call('DEL', KEYS[4])
  return 0
end
redis.call('HSET', KEYS[4], 'cap', math.floor(math.max(room / 2, expect)), 'admitted', expect)
take()
return 1
"""

ADMITTED, WAIT, REFUSED, CLOSED = 1, 2, 0, -1


def micro_usd(cost: float) -> int:
    return int(round(cost * 1_000_000))


def _decode_hash(h: dict) -> dict[str, int]:
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in h.items()}


class Ledger:
    def __init__(self, client: redis.Redis):
        self.r = client
        self._count = client.register_script(_COUNT_ONCE)
        self._admit = client.register_script(_ADMIT)

    # -- counting --------------------------------------------------------------------------
    def count(self, record: ResponseRecord, now: float | None = None) -> bool:
        """Add a stored record to the totals (and free its reservation); False if already counted."""
        bucket = int((now or time.time()) // RATE_BUCKET_S)
        added = self._count(
            keys=[rk.counted_set(record.dataset), rk.totals(record.dataset, record.backend), rk.spend(record.backend),
                  rk.dataset_totals(record.dataset), rk.reservations(record.dataset),
                  rk.rate(record.dataset, record.backend, bucket)],
            args=[record.key, record.prompt_tokens, record.completion_tokens, micro_usd(record.cost_usd), RATE_KEEP_S,
                  int(getattr(record, "latency_s", 0.0) * 1000)],
        )
        return bool(added)

    def charge(self, backend: str, cost_usd: float) -> None:
        """Add a generation no stored record carries (a twin stored the key first) to the backend's
        spend: it was paid for, and the spend cap must see it."""
        if cost_usd:
            self.r.hincrby(rk.spend(backend), "cost_micro_usd", micro_usd(cost_usd))

    def event(self, dataset: str, name: str, n: int = 1) -> None:
        """Count a retry, failure or skip by reason (``retry:http_429``, ``failed:timeout``...)."""
        self.r.hincrby(rk.events(dataset), name, n)

    def events(self, dataset: str) -> dict[str, int]:
        return _decode_hash(self.r.hgetall(rk.events(dataset)))

    # -- budgets ---------------------------------------------------------------------------
    def expected_tokens(self, dataset: str, max_tokens: int) -> int:
        """Tokens a response of this dataset is expected to take: the running mean, once known."""
        t = _decode_hash(self.r.hgetall(rk.dataset_totals(dataset)))
        if t.get("responses", 0) >= 5:
            return max(1, round(t["completion_tokens"] / t["responses"]))
        return max(1, max_tokens // 2)

    def admit(self, dataset: str, key: str, budget: int, expected: int, max_tokens: int) -> int:
        """ADMITTED (reservation held), WAIT (no room unless what is in flight comes in short),
        REFUSED (this call closed the dataset) or CLOSED. Needs the task's claim to be held."""
        return int(self._admit(
            keys=[rk.dataset_totals(dataset), rk.reservations(dataset), rk.closed(dataset), rk.closing(dataset)],
            args=[key, budget, expected, rk.claim(dataset, ""), max_tokens],
        ))

    def release(self, dataset: str, key: str) -> None:
        self.r.hdel(rk.reservations(dataset), key)

    def closed_at(self, dataset: str) -> int | None:
        """The budget the dataset was closed at, or None when it is open."""
        v = self.r.get(rk.closed(dataset))
        return int(v) if v is not None else None

    def reopen(self, dataset: str) -> None:
        self.r.delete(rk.closed(dataset), rk.closing(dataset))

    # -- reading ---------------------------------------------------------------------------
    def spend_usd(self, backend: str) -> float:
        return int(self.r.hget(rk.spend(backend), "cost_micro_usd") or 0) / 1_000_000

    def dataset_totals(self, dataset: str) -> dict[str, int]:
        return _decode_hash(self.r.hgetall(rk.dataset_totals(dataset)))

    def all_totals(self, dataset: str = "*") -> dict[str, dict[str, dict[str, int]]]:
        """Counters by dataset, then backend, in one scan (dataset names never hold a colon)."""
        keys = list(self.r.scan_iter(match=rk.totals_pattern(dataset), count=500))
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        out: dict[str, dict[str, dict[str, int]]] = {}
        prefix = len(rk.totals("", "")) - 1
        for key, values in zip(keys, pipe.execute()):
            name, backend = key.decode()[prefix:].split(":", 1)
            out.setdefault(name, {})[backend] = _decode_hash(values)
        return out

    def totals(self, dataset: str) -> dict[str, dict[str, int]]:
        """Counters of one dataset, by backend."""
        return self.all_totals(dataset).get(dataset, {})

    def rates(self, dataset: str, backends: list[str], windows: list[int],
              now: float | None = None) -> dict[str, list[float]]:
        """Completion tokens per second of each backend over each window (seconds), in one round trip.

        A window longer than the dataset's run so far (since the first bucket in which any of its
        backends counted a response) is measured over the run's age instead: a run two minutes old
        must not read as a fifth of its speed over a ten-minute window.
        """
        now = time.time() if now is None else now
        last = int(now // RATE_BUCKET_S)
        n = RATE_KEEP_S // RATE_BUCKET_S
        first_bucket = last - n + 1
        pipe = self.r.pipeline(transaction=False)
        for backend in backends:
            for b in range(first_bucket, last + 1):
                pipe.hget(rk.rate(dataset, backend, b), "completion_tokens")
        values = [int(v or 0) for v in pipe.execute()]
        per = {backend: values[k * n:(k + 1) * n] for k, backend in enumerate(backends)}
        started = min((i for tokens in per.values() for i, v in enumerate(tokens) if v), default=0)
        # the oldest kept bucket: the run is at least that old; never less than one bucket
        age = float("inf") if started == 0 else max(RATE_BUCKET_S, now - (first_bucket + started) * RATE_BUCKET_S)
        out = {}
        for backend, tokens in per.items():
            out[backend] = [sum(tokens[n - max(1, w // RATE_BUCKET_S):]) / min(age, max(1, w // RATE_BUCKET_S) * RATE_BUCKET_S)
                            for w in windows]
        return out
