"""The ledger's Lua scripts: each runs in Redis as one step, so no other worker's count, admission
or release falls between its reads and its writes (``ledger.py`` says what each keeps true).

``SETTLE`` is not run alone: it is the part the others share (a reservation's entry parsed, the
aggregates loaded once, changed in Lua, and saved once).
"""

from __future__ import annotations

# The dataset counters that the budget has spent (admission's committed tokens, ``budget_use``):
# the counted records' completion tokens, and the paid turns of conversations not stored yet.
BUDGET_FIELDS = ("completion_tokens", "paid_tokens")

# A reservation's entry is ``expected:admitted_ms:state:cap:token``: its own cap (its task's
# max_tokens x turns left, what it may grow to) and the token of the claim it was taken under, so
# that only that claim's task releases it and the due check drops it once that claim is gone.
# The aggregates (hash ``agg``): n, ey = Σ expected of young ones, no / so / co = count, Σ(admitted
# - t0) and Σ cap of old ones, cc = Σ cap of capped ones, t0 = origin of admission times (reset
# when empty). A script reads them once (load), changes them in Lua, and writes them once (save).
# settle(reservations, due, A, key, token) drops a reservation (only the token's, when one is
# given) and takes its share out of A.
SETTLE = """
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
-- take a parsed entry's share out of A (its entry is deleted by the caller)
local function share_out(A, e, s, st, c)
  A.n = A.n - 1
  if st == 'y' then A.ey = A.ey - e
  elseif st == 'o' then A.no = A.no - 1 A.so = A.so - (s - A.t0) A.co = A.co - c
  else A.cc = A.cc - c end
end
local function settle(res, due, A, k, token)
  local v = redis.call('HGET', res, k)
  if not v then return 0 end  -- (a due entry left without its reservation is dropped when due)
  local e, s, st, c, tok = parse(v)
  if token and tok ~= token then return 0 end  -- another copy's: not this task's to release
  redis.call('HDEL', res, k)
  redis.call('ZREM', due, k)
  if not st then return 0 end  -- not an entry of this format: it has no share in the aggregates
  share_out(A, e, s, st, c)
  return 1
end
-- a lease (ledger.py: a worker's reservation of several tasks' caps, state 'c') loses ``amount``
-- of its cap (slots counted or given back); spent, it is dropped, and its claim (``claim_prefix``
-- .. name) with it, while still its own
local function shrink(res, due, A, name, v, amount, claim_prefix)
  local e, s, st, c, tok = parse(v)
  if st ~= 'c' then return false end
  if c <= amount then
    redis.call('HDEL', res, name)
    redis.call('ZREM', due, name)
    share_out(A, e, s, st, c)
    if redis.call('GET', claim_prefix .. name) == tok then redis.call('DEL', claim_prefix .. name) end
  else
    redis.call('HSET', res, name, e .. ':' .. s .. ':c:' .. (c - amount) .. ':' .. tok)
    A.cc = A.cc - amount
  end
  return true
end
local function settle_one(res, due, agg, k, token)
  local A = load(agg)
  if settle(res, due, A, k, token) == 1 then save(agg, A) return 1 end
  return 0
end
"""

COUNT_ONCE = SETTLE + """
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

# Counting a worker's stored results in batches (workers/tally.py): what COUNT_ONCE does for one
# record, done for many in one step, with the counters written once per batch (not once per record
# and field: the per-record HINCRBY loop was most of what a result cost the shared Redis), and each
# result's claim released in the same step. Single answers only (a conversation's turns go through
# COUNT_ONCE, for its paid marks).
# KEYS[1] = the backend's spend; then 8 keys per dataset: counted set, totals(dataset, backend),
# dataset totals, reservations, due index, aggregates, the rate bucket, events.
# ARGV[1] = RATE_KEEP_S; ARGV[2] = cjson, per dataset: {claim key prefix, records}, each record
# [key, prompt, completion, micro_usd, latency_ms, end_ms, start_ms, provider (0/1), claim token,
# truncated (0/1), lease ('' when admitted alone), the lease's cap a slot], in the order they were
# stored (the busy-time union runs in that order).
# Returns how many records were newly counted.
COUNT_BATCH = SETTLE + """
local groups = cjson.decode(ARGV[2])
local spend, added = 0, 0
for g, grp in ipairs(groups) do
  local o = 1 + (g - 1) * 8
  local cset, tot, dst, res, due, agg, rate, events =
    KEYS[o + 1], KEYS[o + 2], KEYS[o + 3], KEYS[o + 4], KEYS[o + 5], KEYS[o + 6], KEYS[o + 7], KEYS[o + 8]
  local recs, ks, first = grp[2], {}, {}
  for _, r in ipairs(recs) do
    if not first[r[1]] then first[r[1]] = true ks[#ks + 1] = r[1] end
  end
  -- settle each key's reservation, whichever copy took it (as COUNT_ONCE): one read, one delete
  local A, dirty, gone = load(agg), false, {}
  for i, v in ipairs(redis.call('HMGET', res, unpack(ks))) do
    if v then
      gone[#gone + 1] = ks[i]
      local e, s, st, c = parse(v)
      if st then share_out(A, e, s, st, c) dirty = true end
    end
  end
  if #gone > 0 then redis.call('HDEL', res, unpack(gone)) end
  redis.call('ZREM', due, unpack(ks))
  -- each record admitted under a lease takes its slot out of that lease (counted new or not: its task is done)
  local dec, leases = {}, {}
  for _, r in ipairs(recs) do
    local ln = r[11]
    if ln ~= '' then
      if not dec[ln] then dec[ln] = 0 leases[#leases + 1] = ln end
      dec[ln] = dec[ln] + r[12]
    end
  end
  if #leases > 0 then
    for i, v in ipairs(redis.call('HMGET', res, unpack(leases))) do
      if v and shrink(res, due, A, leases[i], v, dec[leases[i]], grp[1]) then dirty = true end
    end
  end
  if dirty then save(agg, A) end
  -- count once: only the keys not counted yet (one check, one add)
  local known, new = redis.call('SMISMEMBER', cset, unpack(ks)), {}
  for i, k in ipairs(ks) do if known[i] == 0 then new[k] = true end end
  local n, pt, ct, cost, lat, sq, ptok, pcost, rt, trunc = 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
  local busy_until = tonumber(redis.call('HGET', tot, 'busy_until_ms') or '0')
  local busy_ms, busy_tokens, busy_moved, fresh = 0, 0, false, {}
  for _, r in ipairs(recs) do
    if new[r[1]] then
      new[r[1]] = nil
      fresh[#fresh + 1] = r[1]
      local c = tonumber(r[3])
      n = n + 1 pt = pt + r[2] ct = ct + c cost = cost + r[4] lat = lat + r[5] sq = sq + c * c
      if r[8] == 1 then ptok = ptok + c pcost = pcost + r[4] end
      if r[10] == 1 then trunc = trunc + 1 end
      local e, s = r[6], r[7]
      if e > 0 then  -- a rate sample: the 10-second bucket, and the backend's busy time (the union)
        rt = rt + c
        if e > busy_until then busy_ms = busy_ms + e - math.max(s, busy_until) busy_until = e busy_moved = true end
        busy_tokens = busy_tokens + c
      end
    end
  end
  if n > 0 then
    redis.call('SADD', cset, unpack(fresh))
    for _, h in ipairs({tot, dst}) do
      redis.call('HINCRBY', h, 'responses', n)
      redis.call('HINCRBY', h, 'prompt_tokens', pt)
      redis.call('HINCRBY', h, 'completion_tokens', ct)
      redis.call('HINCRBY', h, 'cost_micro_usd', cost)
    end
    redis.call('HINCRBY', dst, 'latency_ms', lat)
    redis.call('HINCRBY', dst, 'completion_tokens_sq', sq)
    if ptok > 0 or pcost > 0 then
      redis.call('HINCRBY', tot, 'provider_tokens', ptok)
      redis.call('HINCRBY', tot, 'provider_cost_micro_usd', pcost)
    end
    if busy_tokens > 0 then
      redis.call('HINCRBY', rate, 'completion_tokens', rt)
      redis.call('HINCRBY', rate, 'responses', n)
      redis.call('EXPIRE', rate, ARGV[1])
      if busy_moved then
        redis.call('HINCRBY', tot, 'busy_ms', busy_ms)
        redis.call('HSET', tot, 'busy_until_ms', busy_until)
      end
      redis.call('HINCRBY', tot, 'busy_tokens', busy_tokens)
    end
    if trunc > 0 then redis.call('HINCRBY', events, 'truncated', trunc) end
    spend = spend + cost
    added = added + n
  end
  -- release each record's claim, only under its own token (one read, one delete)
  local names = {}
  for i, r in ipairs(recs) do names[i] = grp[1] .. r[1] end
  local mine = {}
  for i, holder in ipairs(redis.call('MGET', unpack(names))) do
    if holder == recs[i][9] then mine[#mine + 1] = names[i] end
  end
  if #mine > 0 then redis.call('DEL', unpack(mine)) end
end
redis.call('HINCRBY', KEYS[1], 'cost_micro_usd', spend)
return added
"""

# A conversation's turn, paid: its cost to the spend (always, from the worker that paid it; from
# the reconciler only when it was not marked), and its tokens to the dataset's paid_tokens once
# per (key, turn), unless the key is counted already (a twin's record holds the conversation).
PREPAY = """
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
REBUILD_PAID = """
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
RESTORE = SETTLE + """
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
CHARGE = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], 'cost_micro_usd', ARGV[2])
return 1
"""

RELEASE = SETTLE + "return settle_one(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])"

# Drop a reservation only if the claim it was taken under is gone (checked here, atomically with
# the drop): the key unclaimed, or claimed by another copy.
DROP_DEAD = SETTLE + """
local e, s, st, c, tok = parse(redis.call('HGET', KEYS[1], ARGV[1]))
if st and redis.call('GET', ARGV[2] .. ARGV[1]) == tok then return 0 end
return settle_one(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
"""

_ADMIT_BODY = """
local seen = nil  -- the dataset's {responses, completion_tokens} as admission read them
local claim_ttl_ms = nil  -- the key's claim TTL when the caller has just set it (CLAIM_ADMIT): no PTTL
local lease_slots, leased = nil, 0  -- LEASE: the slots asked for, the slots granted
local function admit()
local res, due, agg = KEYS[2], KEYS[5], KEYS[6]
-- closed; counters not rebuilt from the store since Redis lost them (or was new): admit nothing on them
local flags = redis.call('MGET', KEYS[3], KEYS[8])
if flags[1] then return -1 end
if not flags[2] then return -2 end
-- one read of the dataset's counters: the mean and spread, and what the budget has spent
-- (BUDGET_FIELDS: the counted records' tokens, the paid turns of conversations not stored)
local f = redis.call('HMGET', KEYS[1], 'completion_tokens', 'responses', 'completion_tokens_sq', 'latency_ms',
                     @BUDGET_FIELDS@)
local counted, responses = tonumber(f[1] or '0'), tonumber(f[2] or '0')
local sq, latency_ms = tonumber(f[3] or '0'), tonumber(f[4] or '0')
seen = {responses, counted}
local committed = 0
for i = 5, #f do committed = committed + tonumber(f[i] or '0') end
local budget, expect, cap_tokens = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
local token = ARGV[9]
-- the budget enqueue published last (assign.py, rk.BUDGETS) wins over the caller's, which may be a second old
local live = redis.call('HGET', KEYS[7], ARGV[8])
if live == 'none' then return 1 end  -- the budget was removed: nothing to reserve against
if live then budget = tonumber(live) or budget end
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
  schedule(ARGV[1], expect, now, 'y', cap_tokens, claim_ttl_ms or redis.call('PTTL', ARGV[4] .. ARGV[1]))
end
if lease_slots then
  -- a lease: as many slots (each its task's cap) as fit in half the room that admission alone would
  -- still give away freely, never in a closing round (those admit task by task)
  if redis.call('EXISTS', KEYS[4]) == 1 then return done(-4) end
  local var = cap_tokens * cap_tokens
  if responses >= 5 then var = math.max(0, sq / responses - (counted / responses) ^ 2) end
  local free = budget - committed - reserved - 3 * math.sqrt(var) * math.sqrt(live + 1)
  local n = math.min(lease_slots, math.floor(free / (2 * cap_tokens)))
  if n < 2 then return done(-4) end
  if A.n <= 0 then A = {n = 0, ey = 0, no = 0, so = 0, co = 0, cc = 0, t0 = now} end
  A.n = A.n + 1
  A.cc = A.cc + n * cap_tokens
  dirty = true
  redis.call('HSET', res, ARGV[1], '0:' .. now .. ':c:' .. n * cap_tokens .. ':' .. token)
  schedule(ARGV[1], 0, now, 'c', n * cap_tokens, claim_ttl_ms)
  leased = n
  return done(1)
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
end
""".replace("@BUDGET_FIELDS@", ", ".join(f"'{f}'" for f in BUDGET_FIELDS))

ADMIT = SETTLE + _ADMIT_BODY + "return admit()"

# The claim and the admission in one step (one round trip where there were two): the key's claim
# under ARGV[9] (SET NX EX ARGV[10]), then admission as ADMIT; -3 when another task holds the claim
# (nothing reserved). Also returns the dataset's responses and completion tokens as admission read
# them, the running mean the worker reserves from next time (no read of its own).
CLAIM_ADMIT = SETTLE + _ADMIT_BODY + """
if not redis.call('SET', ARGV[4] .. ARGV[1], ARGV[9], 'NX', 'EX', ARGV[10]) then return {-3} end
claim_ttl_ms = tonumber(ARGV[10]) * 1000
local verdict = admit()
if seen then return {verdict, seen[1], seen[2]} end
return {verdict}
"""

# A worker's lease of a dataset's budget (workers/leases.py): the claim of the lease's name ARGV[1]
# under ARGV[9] (SET NX EX ARGV[10]), then up to ARGV[11] slots of ARGV[5] tokens each (its tasks'
# max_tokens) reserved as one capped reservation under that name, in one step with admission's
# due pass. Returns {verdict, slots granted, responses, completion tokens}: -4 when fewer than two
# slots fit or in a closing round, CLOSED and LOST as admission answers them, ADMITTED with no
# slots when the budget was removed; whenever nothing is granted, the claim is let go in the step.
LEASE = SETTLE + _ADMIT_BODY + """
if not redis.call('SET', ARGV[4] .. ARGV[1], ARGV[9], 'NX', 'EX', ARGV[10]) then return {-3, 0} end
claim_ttl_ms = tonumber(ARGV[10]) * 1000
lease_slots = tonumber(ARGV[11])
local verdict = admit()
if leased == 0 then redis.call('DEL', ARGV[4] .. ARGV[1]) end
if seen then return {verdict, leased, seen[1], seen[2]} end
return {verdict, leased}
"""

# Slots of a lease its worker will not use (it expired, the worker stops): ARGV[2] tokens out of
# the lease ARGV[1], only while it is the one taken under the claim token ARGV[3] (claim key
# prefix ARGV[4]); spent, its claim goes too. Returns 1 when it took them out.
LEASE_RETURN = SETTLE + """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v or string.sub(v, -#ARGV[3] - 1) ~= ':' .. ARGV[3] then return 0 end
local A = load(KEYS[3])
if not shrink(KEYS[1], KEYS[2], A, ARGV[1], v, tonumber(ARGV[2]), ARGV[4]) then return 0 end
save(KEYS[3], A)
return 1
"""

# Empty a closed dataset's queue, unless an enqueue reopened it meanwhile (its new tasks stay),
# but for the conversations with paid turns (in paid_keys): each comes once more, to be stopped
# by the budget (event ``stopped:budget``; its turns stay kept, to go on once the budget is raised).
# Only then are the messages read (their kombu envelope's headers.id).
PURGE = """
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
