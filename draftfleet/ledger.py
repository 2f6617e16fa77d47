"""Fast counters and budget admission in Redis; the store stays the truth.

Counting is idempotent: one Lua script adds the key to the dataset's counted set and bumps the
totals only if it was not there, so a redelivered task, or a worker that stored a record and died
before counting it (the next copy finds the record and counts it), never counts twice. The same
script settles the key's budget reservation, so committed and reserved tokens move together.
A conversation's turns count against the budget the moment each is paid (``prepay``: the
dataset's ``paid_tokens``), before its record exists; counting the record moves them into the
totals. Admission's committed tokens are the counted ones plus those.

Budget admission, in two phases. Before generating, a task reserves the dataset's expected tokens
(the running mean). (1) Tasks are admitted freely while committed + reserved + half a response
+ a safety margin (3 standard deviations of the length times the square root of what is in
flight) stays within the budget. A response still running long after admission is a long one
(short ones finish first, and lengths are heavy-tailed), so its reservation grows to twice the
tokens one stream makes in that time, up to max_tokens.
(2) Past that, closing rounds: each waits until nothing is in flight, then admits up to half of
the room left (and never past the budget as published now, which may have been lowered since the
round began); rounds shrink until less than one response fits, and the dataset closes (its
queue is purged, later tasks are skipped). Waiting rounds have no stragglers to guess about, so
the total lands within about one response of the budget.

Admission runs only on counters the store vouches for: ``rk.COUNTERS_BUILT`` is set by the rebuild
from the store alone (reconcile.py) and goes with everything else when Redis loses its data, so
a flushed Redis answers LOST instead of admitting on counters back at zero (which would spend a
closed budget a second time); the spend caps are checked the same way (:meth:`Ledger.spend_known`).

Redis work per admission does not grow with what is in flight. The reserved total is kept as
aggregates updated when a reservation is taken, changes state or is settled: a reservation is
``young`` (it holds its expected tokens), ``old`` (it holds twice what one stream made since its
admission, summed over the group as count x now - sum of admission times, up to the group's caps)
or ``capped`` (it holds its own cap: its task's max_tokens for the turns it has left). Each
reservation sits in a sorted set at the time of its next event: its move to the next state, or
the moment its claim would lapse. An admission handles only the due entries (at most
``EXPIRE_BATCH``): a reservation whose claim is gone (its worker died) or is another copy's is
dropped, a live one is rescheduled, so each reservation costs O(log n) a claim TTL, not a scan
per admission. A reservation belongs to the claim it was taken under: only that claim's task
releases it, so a stale copy (its claim lapsed, the key claimed again) never frees the
reservation of the copy that runs now.
"""

from __future__ import annotations

import time

import msgspec
import redis

from draftfleet import redis_keys as rk
from draftfleet.schemas.records import ChargeRecord, ResponseRecord

RATE_BUCKET_S = 10
RATE_KEEP_S = 900
# Due reservations handled by one admission (the rest by the next ones), so none waits on a backlog.
EXPIRE_BATCH = 64
# The dataset counters that the budget has spent (admission's committed tokens, ``budget_use``):
# the counted records' completion tokens, and the paid turns of conversations not stored yet.
BUDGET_FIELDS = ("completion_tokens", "paid_tokens")
# When to look again at a reservation whose claim has no TTL (claims always have one in the fleet).
RECHECK_MS = 30_000

# A reservation's entry is ``expected:admitted_ms:state:cap:token``: its own cap (its task's
# max_tokens x turns left, what it may grow to) and the token of the claim it was taken under, so
# that only that claim's task releases it and the due check drops it once that claim is gone.
# The aggregates (hash ``agg``): n, ey = Σ expected of young ones, no / so / co = count, Σ(admitted
# - t0) and Σ cap of old ones, cc = Σ cap of capped ones, t0 = origin of admission times (reset
# when empty). A script reads them once (load), changes them in Lua, and writes them once (save).
# settle(reservations, due, A, key, token) drops a reservation (only the token's, when one is
# given) and takes its share out of A.
_SETTLE = """
local function parse(v)
  local e, s, st, c, tok = string.match(v or '', '^(%d+):(%d+):(%a):(%d+):(.*)$')
  if not st then return nil end
  return tonumber(e), tonumber(s), st, tonumber(c), tok
end
local function load(agg)
  local a = redis.call('HMGET', agg, 'n', 'ey', 'no', 'so', 'co', 'cc', 't0')
  return {n = tonumber(a[1] or '0'), ey = tonumber(a[2] or '0'), no = tonumber(a[3] or '0'),
          so = tonumber(a[4] or '0'), co = tonumber(a[5] or '0'), cc = tonumber(a[6] or '0'),
          t0 = tonumber(a[7] or '0')}
end
local function save(agg, A)
  if A.n <= 0 then redis.call('DEL', agg) return end
  redis.call('HSET', agg, 'n', A.n, 'ey', A.ey, 'no', A.no, 'so', A.so, 'co', A.co, 'cc', A.cc, 't0', A.t0)
end
local function settle(res, due, A, k, token)
  local v = redis.call('HGET', res, k)
  if not v then return 0 end  -- (a due entry left without its reservation is dropped when due)
  local e, s, st, c, tok = parse(v)
  if token and tok ~= token then return 0 end  -- another copy's: not this task's to release
  redis.call('HDEL', res, k)
  redis.call('ZREM', due, k)
  if not st then return 0 end  -- not an entry of this format: it has no share in the aggregates
  A.n = A.n - 1
  if st == 'y' then A.ey = A.ey - e
  elseif st == 'o' then A.no = A.no - 1 A.so = A.so - (s - A.t0) A.co = A.co - c
  else A.cc = A.cc - c end
  return 1
end
local function settle_one(res, due, agg, k, token)
  local A = load(agg)
  if settle(res, due, A, k, token) == 1 then save(agg, A) return 1 end
  return 0
end
"""

_COUNT_ONCE = _SETTLE + """
settle_one(KEYS[5], KEYS[7], KEYS[8], ARGV[1])
local added = redis.call('SADD', KEYS[1], ARGV[1])
if added == 1 then
  for _, h in ipairs({KEYS[2], KEYS[4]}) do
    redis.call('HINCRBY', h, 'responses', 1)
    redis.call('HINCRBY', h, 'prompt_tokens', ARGV[2])
    redis.call('HINCRBY', h, 'completion_tokens', ARGV[3])
    redis.call('HINCRBY', h, 'cost_micro_usd', ARGV[4])
  end
  if #KEYS == 8 then
    redis.call('HINCRBY', KEYS[3], 'cost_micro_usd', ARGV[4])
  else  -- a conversation: each turn to the spend of the backend that paid it, unless added when paid
    for i = 11, #KEYS do
      if redis.call('HEXISTS', KEYS[9], i - 11) == 0 then redis.call('HINCRBY', KEYS[i], 'cost_micro_usd', ARGV[i - 1]) end
    end
  end
  redis.call('HINCRBY', KEYS[4], 'latency_ms', ARGV[6])
  redis.call('HINCRBY', KEYS[4], 'completion_tokens_sq', tonumber(ARGV[3]) * tonumber(ARGV[3]))
  if ARGV[9] == '1' then  -- the provider's own reported cost: what a measured $/Mtok is made of
    redis.call('HINCRBY', KEYS[2], 'provider_tokens', ARGV[3])
    redis.call('HINCRBY', KEYS[2], 'provider_cost_micro_usd', ARGV[4])
  end
  local e, s = tonumber(ARGV[7]), tonumber(ARGV[8])
  if e > 0 then  -- a rate sample: the 10-second bucket, and the backend's busy time (the union of its requests)
    redis.call('HINCRBY', KEYS[6], 'completion_tokens', ARGV[3])
    redis.call('HINCRBY', KEYS[6], 'responses', 1)
    redis.call('EXPIRE', KEYS[6], ARGV[5])
    local busy_until = tonumber(redis.call('HGET', KEYS[2], 'busy_until_ms') or '0')
    if e > busy_until then
      redis.call('HINCRBY', KEYS[2], 'busy_ms', e - math.max(s, busy_until))
      redis.call('HSET', KEYS[2], 'busy_until_ms', e)
    end
    redis.call('HINCRBY', KEYS[2], 'busy_tokens', ARGV[3])
  end
end
if #KEYS > 8 then  -- the conversation's paid turns are in its record's count now (or were already)
  local paid = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[9])) do paid = paid + tonumber(v) end
  if paid ~= 0 then redis.call('HINCRBY', KEYS[4], 'paid_tokens', -paid) end
  redis.call('DEL', KEYS[9])
  redis.call('SREM', KEYS[10], ARGV[1])
end
return added
"""

# A conversation's turn, paid: its cost to the spend (always, from the worker that paid it; from
# the reconciler only when it was not marked), and its tokens to the dataset's paid_tokens once
# per (key, turn), unless the key is counted already (a twin's record holds the conversation).
_PREPAY = """
local new = 0
if redis.call('SISMEMBER', KEYS[5], ARGV[4]) == 0 then
  new = redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[3])
  if new == 1 then
    redis.call('HINCRBY', KEYS[3], 'paid_tokens', ARGV[3])
    redis.call('SADD', KEYS[4], ARGV[4])
  end
end
if (new == 1 or ARGV[5] == '1') and tonumber(ARGV[2]) ~= 0 then redis.call('HINCRBY', KEYS[1], 'cost_micro_usd', ARGV[2]) end
return new
"""

# The reconciler's rebuild of paid_tokens: the sum over the marks of keys not counted; the marks
# of counted keys (a twin marked a turn after the count) are dropped. Atomic: no worker's mark or
# count can fall between the sum and the write.
_REBUILD_PAID = """
local total = 0
for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local h = ARGV[1] .. k
  if redis.call('SISMEMBER', KEYS[2], k) == 1 or redis.call('EXISTS', h) == 0 then
    redis.call('DEL', h)
    redis.call('SREM', KEYS[1], k)
  else
    for _, v in ipairs(redis.call('HVALS', h)) do total = total + tonumber(v) end
  end
end
local have = tonumber(redis.call('HGET', KEYS[3], 'paid_tokens') or '0')
if have ~= total then redis.call('HSET', KEYS[3], 'paid_tokens', total) end
return total - have
"""

# After Redis lost its data: a reservation again for a key a running task holds (its claim, put back
# by its worker's heartbeat) that has none and is not counted, so that a rebuilt budget sees it.
_RESTORE = _SETTLE + """
local tok = redis.call('GET', ARGV[4] .. ARGV[1])
if not tok or redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 1 then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local A = load(KEYS[3])
if A.n <= 0 then A = {n = 0, ey = 0, no = 0, so = 0, co = 0, cc = 0, t0 = now} end
A.n = A.n + 1
A.ey = A.ey + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. now .. ':y:' .. ARGV[3] .. ':' .. tok)
local ttl = redis.call('PTTL', ARGV[4] .. ARGV[1])
redis.call('ZADD', KEYS[2], now + ((ttl > 0) and ttl or tonumber(ARGV[5])), ARGV[1])
save(KEYS[3], A)
return 1
"""

# A charge (a paid generation no record carries) into its backend's spend once, by its id.
_CHARGE = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], 'cost_micro_usd', ARGV[2])
return 1
"""

_RELEASE = _SETTLE + "return settle_one(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])"

# Drop a reservation only if the claim it was taken under is gone (checked here, atomically with
# the drop): the key unclaimed, or claimed by another copy.
_DROP_DEAD = _SETTLE + """
local e, s, st, c, tok = parse(redis.call('HGET', KEYS[1], ARGV[1]))
if st and redis.call('GET', ARGV[2] .. ARGV[1]) == tok then return 0 end
return settle_one(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
"""

_ADMIT = _SETTLE + """
local res, due, agg = KEYS[2], KEYS[5], KEYS[6]
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
-- counters not rebuilt from the store since Redis lost them (or was new): admit nothing on them
if redis.call('EXISTS', KEYS[8]) == 0 then return -2 end
local f = redis.call('HMGET', KEYS[1], 'completion_tokens', 'responses', 'completion_tokens_sq', 'latency_ms')
local counted, responses = tonumber(f[1] or '0'), tonumber(f[2] or '0')
local sq, latency_ms = tonumber(f[3] or '0'), tonumber(f[4] or '0')
-- what the budget has spent (BUDGET_FIELDS: the counted records, the paid turns of conversations not stored)
local committed = 0
for _, v in ipairs(redis.call('HMGET', KEYS[1], @BUDGET_FIELDS@)) do committed = committed + tonumber(v or '0') end
local budget, expect, cap_tokens = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
local token = ARGV[9]
-- the budget enqueue published last (assign.py) wins over the caller's, which may be a second old
local live = redis.call('HGET', KEYS[7], ARGV[8])
if live then
  local b = cjson.decode(live)['budget_tokens']
  if b == cjson.null then return 1 end  -- the budget was removed: nothing to reserve against
  if b then budget = tonumber(b) end
end
local per_stream = 0
if latency_ms > 0 then per_stream = counted / latency_ms end  -- tokens per ms of one stream
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local A, dirty = load(agg), false
local function done(verdict)
  if dirty then save(agg, A) end
  return verdict
end
-- each reservation moves on with its own cap (c), whatever the cap of the task asking now
local function restate(k, e, s, c, tok, from, to)
  if from == 'y' then A.ey = A.ey - e else A.no = A.no - 1 A.so = A.so - (s - A.t0) A.co = A.co - c end
  if to == 'o' then A.no = A.no + 1 A.so = A.so + (s - A.t0) A.co = A.co + c else A.cc = A.cc + c end
  redis.call('HSET', res, k, e .. ':' .. s .. ':' .. to .. ':' .. c .. ':' .. tok)
  dirty = true
end
-- next event of a reservation: its move to the next state, or when its claim would lapse
local function schedule(k, e, s, st, c, claim_ttl)
  local at = now + ((claim_ttl > 0) and claim_ttl or tonumber(ARGV[6]))
  if per_stream > 0 then
    if st == 'y' then at = math.min(at, s + math.ceil(e / (2 * per_stream)))
    elseif st == 'o' then at = math.min(at, s + math.ceil(c / (2 * per_stream))) end
  end
  redis.call('ZADD', due, math.max(at, now + 1), k)
end

-- only the due reservations: drop those whose claim lapsed or passed to another copy (their
-- worker died, or was cut off for longer than a claim TTL), move the rest on
for _, k in ipairs(redis.call('ZRANGEBYSCORE', due, '-inf', now, 'LIMIT', 0, tonumber(ARGV[7]))) do
  local e, s, st, c, tok = parse(redis.call('HGET', res, k))
  if not st then
    redis.call('ZREM', due, k)  -- its reservation was settled: nothing left to look at
  elseif redis.call('GET', ARGV[4] .. k) ~= tok then
    if settle(res, due, A, k) == 1 then dirty = true end
  else
    -- a response still running long after admission is a long one (lengths are heavy-tailed: the
    -- longer it has run, the longer it will run): reserve twice what it has likely made so far
    if st == 'y' and per_stream > 0 and 2 * per_stream * (now - s) >= e then restate(k, e, s, c, tok, 'y', 'o') st = 'o' end
    if st == 'o' and per_stream > 0 and 2 * per_stream * (now - s) >= c then
      restate(k, e, s, c, tok, 'o', 'c') st = 'c'
    end
    schedule(k, e, s, st, c, redis.call('PTTL', ARGV[4] .. k))
  end
end

local live = A.n
local reserved = 0
if live > 0 then
  local grown = 2 * per_stream * (A.no * (now - A.t0) - A.so)
  reserved = A.ey + math.min(A.co, grown) + A.cc
end
local function take()
  settle(res, due, A, ARGV[1])
  if A.n <= 0 then A = {n = 0, ey = 0, no = 0, so = 0, co = 0, cc = 0, t0 = now} end
  A.n = A.n + 1
  A.ey = A.ey + expect
  dirty = true
  redis.call('HSET', res, ARGV[1], expect .. ':' .. now .. ':y:' .. cap_tokens .. ':' .. token)
  schedule(ARGV[1], expect, now, 'y', cap_tokens, redis.call('PTTL', ARGV[4] .. ARGV[1]))
end
if redis.call('EXISTS', KEYS[4]) == 0 then
  local var = expect * expect
  if responses >= 5 then var = math.max(0, sq / responses - (counted / responses) ^ 2) end
  local margin = 3 * math.sqrt(var) * math.sqrt(live + 1)
  if committed + reserved + expect / 2 + margin <= budget then take() return done(1) end
  redis.call('HSET', KEYS[4], 'cap', 0, 'admitted', 0)  -- closing rounds start
end
local cap = tonumber(redis.call('HGET', KEYS[4], 'cap'))
local admitted = tonumber(redis.call('HGET', KEYS[4], 'admitted'))
if live > 0 then
  -- within the round's cap, and within the budget as published now (it may have been lowered
  -- since the round began: its cap was half the room left under the budget of then)
  if admitted + expect <= cap and committed + reserved + expect <= budget then
    take()
    redis.call('HINCRBY', KEYS[4], 'admitted', expect)
    return done(1)
  end
  return done(2)
end
local room = budget - committed
if room < expect then
  redis.call('SET', KEYS[3], budget)
  redis.call('DEL', KEYS[4])
  return done(0)
end
redis.call('HSET', KEYS[4], 'cap', math.floor(math.max(room / 2, expect)), 'admitted', expect)
take()
return done(1)
""".replace("@BUDGET_FIELDS@", ", ".join(f"'{f}'" for f in BUDGET_FIELDS))

# Empty a closed dataset's queue, unless an enqueue reopened it meanwhile (its new tasks stay),
# but for the conversations with paid turns (in paid_keys): each comes once more, to be stopped
# by the budget (event ``stopped:budget``; its turns stay kept, to go on once the budget is raised).
# Only then are the messages read (their kombu envelope's headers.id).
_PURGE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local n = redis.call('LLEN', KEYS[2])
if redis.call('SCARD', KEYS[3]) == 0 then redis.call('DEL', KEYS[2]) return n end
local keep = {}
for _, raw in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  local ok, env = pcall(cjson.decode, raw)
  local id = ok and type(env) == 'table' and type(env.headers) == 'table' and env.headers.id
  if type(id) == 'string' and redis.call('SISMEMBER', KEYS[3], id) == 1 then keep[#keep + 1] = raw end
end
redis.call('DEL', KEYS[2])
for i = 1, #keep, 1000 do redis.call('RPUSH', KEYS[2], unpack(keep, i, math.min(i + 999, #keep))) end
return n - #keep
"""

# LOST: the counters are not known to be the store's (``rk.COUNTERS_BUILT`` is gone): rebuild them first.
ADMITTED, WAIT, REFUSED, CLOSED, LOST = 1, 2, 0, -1, -2


class BudgetUse(msgspec.Struct, frozen=True, kw_only=True):
    """What a dataset's budget has spent and has left, as admission counts it (:func:`budget_use`).

    Admission and every view (status, plan, metrics, report, inventory) take the figure from
    here, so that a view never promises room that admission refuses."""

    budget_tokens: int | None
    stored_tokens: int  # completion tokens of the dataset's stored (counted) records, every version
    paid_tokens: int  # tokens of the paid turns of conversations with no record yet (kept in _progress/)
    spent_tokens: int  # the two together: what admission counts as committed
    left_tokens: int | None  # the budget less what is spent (None: no budget)
    expected_tokens: int  # what admission reserves for the next prompt (:func:`reservation`)
    full: bool  # less than that is left: admission refuses the next prompt and the dataset closes


def budget_use(budget: int | None, stored: int, paid: int, expected: int) -> BudgetUse:
    """The one definition of a budget's use: spent = stored records + paid turns not stored."""
    spent = stored + paid
    left = None if budget is None else max(0, budget - spent)
    return BudgetUse(budget_tokens=budget, stored_tokens=stored, paid_tokens=paid, spent_tokens=spent,
                     left_tokens=left, expected_tokens=expected, full=left is not None and left < expected)


def expected_tokens(responses: int, completion_tokens: int, max_tokens: int) -> int:
    """Tokens the next response of a dataset is expected to take: the running mean once five are
    counted, else half of ``max_tokens`` (what admission reserves)."""
    if responses >= 5:
        return max(1, round(completion_tokens / responses))
    return max(1, max_tokens // 2)


def reservation(responses: int, completion_tokens: int, max_tokens: int, turns: int = 1,
                turns_left: int | None = None) -> int:
    """What admission reserves for a prompt of ``turns`` answers, ``turns_left`` of them still to
    come (default all: a new one). A record is a whole conversation, so the expected tokens per
    record (before five: half of ``max_tokens`` for each turn) are scaled to the turns left. The
    worker's admission and every view's ``full`` take it from here, so they cannot disagree."""
    turns_left = turns if turns_left is None else turns_left
    return max(1, expected_tokens(responses, completion_tokens, max_tokens * turns) * turns_left // turns)


def micro_usd(cost: float) -> int:
    return int(round(cost * 1_000_000))


def _decode_hash(h: dict) -> dict[str, int]:
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in h.items()}


class Ledger:
    def __init__(self, client: redis.Redis):
        self.r = client
        self._count = client.register_script(_COUNT_ONCE)
        self._admit = client.register_script(_ADMIT)
        self._purge = client.register_script(_PURGE)
        self._release = client.register_script(_RELEASE)
        self._drop_dead = client.register_script(_DROP_DEAD)
        self._prepay = client.register_script(_PREPAY)
        self._rebuild_paid = client.register_script(_REBUILD_PAID)
        self._charge = client.register_script(_CHARGE)
        self._restore = client.register_script(_RESTORE)

    # -- counting --------------------------------------------------------------------------
    def count(self, record: ResponseRecord, now: float | None = None, *, rate: bool = True) -> bool:
        """Add a stored record to the totals (and free its reservation); False if already counted.

        A conversation's turns go to the spend of the backend that paid each, except those
        :meth:`prepay` added when they were paid; the tokens its marks hold leave ``paid_tokens``,
        now in the totals (the marks are consumed, also when the key was counted before): each paid
        turn is in the spend once and in the budget once, whether its conversation is stored or not.

        ``rate``: the record was made just now by the backend it names, so it is a sample of that
        backend's speed (the 10-second rate buckets, and its busy time: the union of its requests'
        intervals, ``busy_ms`` over ``busy_tokens`` in its totals). Records brought in by
        ``import`` or counted late by the reconciler are no backend's rate: ``rate=False``.
        """
        bucket = int((now or time.time()) // RATE_BUCKET_S)
        end_ms = int(record.created_at * 1000) if rate else 0
        start_ms = end_ms - int(record.latency_s * 1000) if rate else 0
        turns = getattr(record, "turns", None) or []
        conversation = [rk.prepaid(record.dataset, record.key), rk.paid_keys(record.dataset),
                        *(rk.spend(t.backend) for t in turns)] if turns else []
        added = self._count(
            keys=[rk.counted_set(record.dataset), rk.totals(record.dataset, record.backend), rk.spend(record.backend),
                  rk.dataset_totals(record.dataset), rk.reservations(record.dataset),
                  rk.rate(record.dataset, record.backend, bucket), *self._reservation_index(record.dataset),
                  *conversation],
            args=[record.key, record.prompt_tokens, record.completion_tokens, micro_usd(record.cost_usd), RATE_KEEP_S,
                  int(getattr(record, "latency_s", 0.0) * 1000), end_ms, start_ms,
                  int(getattr(record, "cost_source", "none") == "provider"), *(micro_usd(t.cost_usd) for t in turns)],
        )
        return bool(added)

    def prepay(self, dataset: str, key: str, turn: int, backend: str, cost_usd: float, tokens: int,
               *, paid_now: bool = True) -> bool:
        """Count a conversation's turn as soon as it is paid: its cost in ``backend``'s spend, its
        ``tokens`` against the dataset's budget (``paid_tokens``), and a mark so that counting the
        stored record moves the tokens to the totals and does not add the cost again. Whether the
        turn was newly marked.

        The turns of a conversation handed back between turns, paused, failed at a later turn or
        stopped by the budget were paid all the same: the spend cap and budget admission must see
        them now, not only once (if ever) the record is stored. The tokens count once per (key,
        turn); the cost counts every time it was paid (``paid_now``: a worker that paid it), else
        (the reconciler, from a kept turn whose mark Redis lost) only with a new mark.
        """
        return bool(self._prepay(
            keys=[rk.spend(backend), rk.prepaid(dataset, key), rk.dataset_totals(dataset), rk.paid_keys(dataset),
                  rk.counted_set(dataset)],
            args=[turn, micro_usd(cost_usd), tokens, key, int(paid_now)],
        ))

    def rebuild_paid(self, dataset: str) -> int:
        """Set ``paid_tokens`` to the sum of the marks of conversations not counted (dropping the
        marks of counted ones); the correction made."""
        return int(self._rebuild_paid(keys=[rk.paid_keys(dataset), rk.counted_set(dataset), rk.dataset_totals(dataset)],
                                      args=[rk.prepaid(dataset, "")]))

    def paid_marks(self, dataset: str, key: str) -> set[int]:
        """The turns of a conversation marked as paid."""
        return {int(t) for t in self.r.hkeys(rk.prepaid(dataset, key))}

    def charge(self, charge: ChargeRecord) -> bool:
        """Add a generation no stored record carries (a twin stored the key first, or an answer
        billed but unusable: empty, not re-tokenizable) to the backend's spend, once by its id:
        it was paid for, and the spend cap must see it. The caller keeps it in the store first
        (``Store.put_charge``), so that the spend rebuilt after Redis lost it holds it too. (A
        conversation's turns are added as they are paid: :meth:`prepay`.) Whether it was new."""
        return bool(self._charge(keys=[rk.CHARGED, rk.spend(charge.backend)], args=[charge.id, micro_usd(charge.cost_usd)]))

    def counters_built(self) -> bool:
        """Whether the counters were rebuilt from the store since Redis last lost its data
        (``rk.COUNTERS_BUILT``): only then do admission and the spend caps trust them."""
        return bool(self.r.exists(rk.COUNTERS_BUILT))

    def event(self, dataset: str, name: str, n: int = 1) -> None:
        """Count a retry, failure or skip by reason (``retry:http_429``, ``failed:timeout``...)."""
        self.r.hincrby(rk.events(dataset), name, n)

    def events(self, dataset: str) -> dict[str, int]:
        return _decode_hash(self.r.hgetall(rk.events(dataset)))

    # -- budgets ---------------------------------------------------------------------------
    def expected_tokens(self, dataset: str, max_tokens: int) -> int:
        """Tokens a response of this dataset is expected to take: the running mean, once known."""
        return self.reservation(dataset, max_tokens)

    def reservation(self, dataset: str, max_tokens: int, turns: int = 1, turns_left: int | None = None) -> int:
        """What :meth:`admit` is asked to reserve for a prompt of this dataset (:func:`reservation`)."""
        t = self.dataset_totals(dataset)
        return reservation(t.get("responses", 0), t.get("completion_tokens", 0), max_tokens, turns, turns_left)

    def budget_use(self, dataset: str, budget: int | None, max_tokens: int, turns: int = 1) -> BudgetUse:
        """The dataset's budget as admission sees it now (``max_tokens``: its tasks'; ``turns``: the
        answers of the next prompt, a new conversation's turns)."""
        t = self.dataset_totals(dataset)
        stored, paid = (t.get(f, 0) for f in BUDGET_FIELDS)
        return budget_use(budget, stored, paid, reservation(t.get("responses", 0), stored, max_tokens, turns))

    def admit(self, dataset: str, key: str, token: str, budget: int, expected: int, max_tokens: int) -> int:
        """ADMITTED (reservation held), WAIT (no room unless what is in flight comes in short),
        REFUSED (this call closed the dataset), CLOSED, or LOST (the counters were not rebuilt
        from the store since Redis lost its data: nothing is admitted on them). Needs the task's claim, held under
        ``token``: the reservation is that claim's (released by it, dropped once it is gone).
        ``max_tokens`` is the most the task can make, what its reservation may grow to.

        ``budget`` counts only while the dataset has no published budget (assign.py)."""
        return int(self._admit(
            keys=[rk.dataset_totals(dataset), rk.reservations(dataset), rk.closed(dataset), rk.closing(dataset),
                  *self._reservation_index(dataset), rk.DATASETS, rk.COUNTERS_BUILT],
            args=[key, budget, expected, rk.claim(dataset, ""), max_tokens, RECHECK_MS, EXPIRE_BATCH, dataset, token],
        ))

    @staticmethod
    def _reservation_index(dataset: str) -> list[str]:
        return [rk.reservations_due(dataset), rk.reserved_sum(dataset)]

    def release(self, dataset: str, key: str, token: str) -> None:
        """Settle the reservation the task holding the claim ``token`` took (it ends without a
        counted result); one another copy of the key took since is left alone."""
        self._release(keys=[rk.reservations(dataset), *self._reservation_index(dataset)], args=[key, token])

    def restore(self, dataset: str, max_tokens: int) -> int:
        """Reserve again for every key of ``dataset`` a running task holds with no reservation (Redis
        lost them, and the worker's heartbeat put its claims back): the expected tokens of a new
        prompt, growing as any reservation does up to ``max_tokens``; how many."""
        prefix = rk.claim(dataset, "")
        held = [k.decode()[len(prefix):] for k in self.r.scan_iter(match=prefix + "*", count=1000)]
        expected = self.reservation(dataset, max_tokens)
        keys = [rk.reservations(dataset), *self._reservation_index(dataset), rk.counted_set(dataset)]
        return sum(int(self._restore(keys=keys, args=[k, expected, max_tokens, prefix, RECHECK_MS])) for k in held)

    def drop_dead(self, dataset: str) -> int:
        """Drop every reservation whose claim is gone or held by another copy (a full pass, for
        the reconciler); how many."""
        entries = {k.decode(): v.decode() for k, v in self.r.hgetall(rk.reservations(dataset)).items()}
        pipe = self.r.pipeline(transaction=False)
        for k in entries:
            pipe.get(rk.claim(dataset, k))
        dead = [k for (k, v), holder in zip(entries.items(), pipe.execute())
                if holder is None or v.split(":", 4)[-1] != holder.decode()]
        index = [rk.reservations(dataset), *self._reservation_index(dataset)]
        return sum(int(self._drop_dead(keys=index, args=[k, rk.claim(dataset, "")])) for k in dead)

    def closed_at(self, dataset: str) -> int | None:
        """The budget the dataset was closed at, or None when it is open."""
        v = self.r.get(rk.closed(dataset))
        return int(v) if v is not None else None

    def reopen(self, dataset: str) -> None:
        self.r.delete(rk.closed(dataset), rk.closing(dataset))

    def purge_closed(self, dataset: str) -> int | None:
        """Drop the queued tasks of a closed dataset, but for conversations with paid turns (each
        comes once more, to be stopped with its turns kept): how many; None if it is open again."""
        n = int(self._purge(keys=[rk.closed(dataset), rk.queue(dataset), rk.paid_keys(dataset)]))
        return None if n < 0 else n

    # -- reading ---------------------------------------------------------------------------
    def spend_usd(self, backend: str) -> float:
        return int(self.r.hget(rk.spend(backend), "cost_micro_usd") or 0) / 1_000_000

    def spend_known(self, backend: str) -> float | None:
        """The backend's spend, in one round trip with whether the counters are the store's; None
        when they are not (Redis lost them): a spend cap must not be checked against them."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(rk.spend(backend), "cost_micro_usd")
        pipe.exists(rk.COUNTERS_BUILT)
        spent, built = pipe.execute()
        return int(spent or 0) / 1_000_000 if built else None

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
