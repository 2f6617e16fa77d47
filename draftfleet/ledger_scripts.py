"""The ledger's Lua scripts: each runs in Redis as one step, so no other worker's count, admission
or release falls between its reads and its writes (``ledger.py`` says what each keeps true).

``SETTLE`` is not run alone: it is the part the others share (a reservation's entry parsed, the
reserved total kept beside the entries).
"""

from __future__ import annotations

# The dataset counters that the budget has spent (admission's committed tokens, ``budget_use``):
# the counted records' completion tokens, and the paid turns of conversations not stored yet.
BUDGET_FIELDS = ("completion_tokens", "paid_tokens")

# A reservation's entry is ``tokens:token``: the most its task can make (the max_tokens it was
# granted, x the turns it has left; a lease's: its free and running slots x their max_tokens), and
# the token of the claim it was taken under, so that only that claim's task releases it and the
# due check drops it once that claim is gone. The reserved total is the field ``r`` of the hash
# ``agg`` (rk.reserved_sum), moved with every entry, so admission never scans the entries.
# settle(reservations, due, agg, key, token) drops a reservation (only the token's, when one is
# given) and takes it out of the total.
SETTLE = """
local function parse(v)
  local c, tok = string.match(v or '', '^(%d+):(.*)$')
  if not c then return nil end
  return tonumber(c), tok
end
local function add(agg, n)
  if n == 0 then return end
  if redis.call('HINCRBY', agg, 'r', n) <= 0 then redis.call('DEL', agg) end
end
-- a reservation whose claim is gone (its worker died, or let go of a result it could not count):
-- its task may have stored an answer not counted yet, so the tokens stay reserved, no longer under
-- any claim (the token emptied), until a pass over the store has counted what it holds (SETTLE_DEAD)
local function bury(res, due, dead, k, c, now)
  redis.call('HSET', res, k, c .. ':')
  redis.call('ZREM', due, k)
  redis.call('ZADD', dead, now, k)
end
local function settle(res, due, agg, k, token)
  local v = redis.call('HGET', res, k)
  if not v then return 0 end
  local c, tok = parse(v)
  if token and tok ~= token then return 0 end  -- another copy's: not this task's to release
  redis.call('HDEL', res, k)
  redis.call('ZREM', due, k)
  if c then add(agg, -c) end
  return 1
end
-- a lease (workers/leases.py: one reservation of several tasks' max_tokens) loses ``amount`` (slots
-- counted or given back); spent, it is dropped with its claim (``claim_prefix`` .. name, while
-- still its own) and the set of keys whose slots it took out (``taken``)
local function shrink(res, due, agg, name, v, amount, claim_prefix, taken)
  local c, tok = parse(v)
  if not c then return false end
  if c <= amount then
    redis.call('HDEL', res, name)
    redis.call('ZREM', due, name)
    add(agg, -c)
    if redis.call('GET', claim_prefix .. name) == tok then redis.call('DEL', claim_prefix .. name) end
    if taken then redis.call('DEL', taken) end
  else
    redis.call('HSET', res, name, (c - amount) .. ':' .. tok)
    add(agg, -amount)
  end
  return true
end
"""

COUNT_ONCE = SETTLE + """
settle(KEYS[5], KEYS[7], KEYS[8], ARGV[1])
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
# dataset totals, reservations, due index, reserved total, the rate bucket, events; then, when a
# record has spend holds, the backend's holds and their total (SPEND_HOLD's KEYS[2], KEYS[3]).
# ARGV[1] = RATE_KEEP_S; ARGV[2] = cjson, per dataset: {claim key prefix, records, lease-taken
# prefix}, each record [key, prompt, completion, micro_usd, latency_ms, end_ms, start_ms, provider
# (0/1), claim token, truncated (0/1), lease ('' when admitted alone), the lease's cap a slot,
# optionally its spend holds [[hold id, token], ...]], in the order they were stored (the busy-time
# union runs in that order).
# A result's slot leaves its lease once however often the batch runs (a reply lost, the batch sent
# again): the lease's set of keys taken out says which already left. A paid result's spend holds
# (its request's worst cost, held against the backend's cap) go in the same step as its cost enters
# the spend, or, for a key counted before (a lost reply, the reconciler's pass), once it is counted:
# each only under its own token and once (a hold gone is not found again), so spent + held never
# drops below what was billed and a batch sent again frees nothing twice.
# A group may be a provider batch's answers (its entry has two more fields: the key-marks prefix,
# rk.prepaid(dataset, ''), and the paid-keys set): each one's grant, held by its batch (BATCH_HOLD's
# "b" mark, in paid_tokens and batch_held), is in the totals once its key is counted, now or
# before (the reconciler's pass, a lost reply): its marks go, once, as COUNT_ONCE's do.
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
  local freed, gone = 0, {}
  for i, v in ipairs(redis.call('HMGET', res, unpack(ks))) do
    if v then
      gone[#gone + 1] = ks[i]
      local c = parse(v)
      if c then freed = freed + c end
    end
  end
  if #gone > 0 then redis.call('HDEL', res, unpack(gone)) redis.call('ZREM', due, unpack(gone)) end
  add(agg, -freed)
  -- each record admitted under a lease takes its slot out of that lease, once per key
  local byl, leases = {}, {}
  for _, r in ipairs(recs) do
    local ln = r[11]
    if ln ~= '' then
      if not byl[ln] then byl[ln] = {keys = {}, slot = r[12]} leases[#leases + 1] = ln end
      local l = byl[ln].keys
      l[#l + 1] = r[1]
    end
  end
  if #leases > 0 then
    for i, v in ipairs(redis.call('HMGET', res, unpack(leases))) do
      local ln = leases[i]
      if v then
        local taken, l = grp[3] .. ln, byl[ln]
        local fresh = {}
        for j, known in ipairs(redis.call('SMISMEMBER', taken, unpack(l.keys))) do
          if known == 0 then fresh[#fresh + 1] = l.keys[j] end
        end
        if #fresh > 0 then
          redis.call('SADD', taken, unpack(fresh))
          redis.call('EXPIRE', taken, 3600)
          shrink(res, due, agg, ln, v, #fresh * l.slot, grp[1], taken)
        end
      end
    end
  end
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
  -- a provider batch's answers: each key is counted now; the grant its batch held goes (once)
  if grp[4] then
    local paid, held, marked = 0, 0, {}
    for _, k in ipairs(ks) do
      local h = grp[4] .. k
      local marks = redis.call('HGETALL', h)
      if #marks > 0 then
        for i = 1, #marks, 2 do
          paid = paid + tonumber(marks[i + 1])
          if marks[i] == 'b' then held = held + tonumber(marks[i + 1]) end
        end
        redis.call('DEL', h)
        marked[#marked + 1] = k
      end
    end
    if paid ~= 0 then redis.call('HINCRBY', dst, 'paid_tokens', -paid) end
    if held ~= 0 then redis.call('HINCRBY', dst, 'batch_held', -held) end
    if #marked > 0 then redis.call('SREM', grp[5], unpack(marked)) end
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
-- every key of the batch is counted now, its cost in the spend: its spend holds go (SPEND_RELEASE's rule)
local hk = 2 + #groups * 8
if #KEYS >= hk + 1 then
  local ids, toks, seen = {}, {}, {}
  for _, grp in ipairs(groups) do
    for _, r in ipairs(grp[2]) do
      if type(r[13]) == 'table' then
        for _, h in ipairs(r[13]) do
          if not seen[h[1]] then seen[h[1]] = true ids[#ids + 1] = h[1] toks[#toks + 1] = h[2] end
        end
      end
    end
  end
  if #ids > 0 then
    local gone, freed = {}, 0
    for i, v in ipairs(redis.call('HMGET', KEYS[hk], unpack(ids))) do
      if v then
        local c, tok = string.match(v, '^(%d+):(.*)$')
        if c and tok == toks[i] then gone[#gone + 1] = ids[i] freed = freed + tonumber(c) end
      end
    end
    if #gone > 0 then
      redis.call('HDEL', KEYS[hk], unpack(gone))
      if redis.call('HINCRBY', KEYS[hk + 1], 'r', -freed) <= 0 then redis.call('DEL', KEYS[hk + 1]) end
    end
  end
end
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

# A prompt submitted in a provider batch holds its grant against the budget with no claim: the mark
# "b" on the key's marks (as a paid turn's), in paid_tokens (committed) and in its share of them,
# batch_held (what admission counts as in flight: it waits on it, never closes on it). Once per key,
# never for a counted one. KEYS: counted set, the key's marks, dataset totals, paid keys; ARGV: key,
# tokens.
BATCH_HOLD = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('HSETNX', KEYS[2], 'b', ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], 'paid_tokens', ARGV[2])
redis.call('HINCRBY', KEYS[3], 'batch_held', ARGV[2])
redis.call('SADD', KEYS[4], ARGV[1])
return 1
"""

# The batch worker's step 2 for one prompt, in one round trip: BATCH_HOLD, then the reservation its
# claim took settled (ARGV[4] == '1'), then the claim let go (only while it is this task's). KEYS:
# counted set, the key's marks, dataset totals, paid keys, reservations, due index, reserved total,
# claim key; ARGV: key, tokens, claim token, whether a reservation was taken.
BATCH_TAKE = SETTLE + """
local held = 0
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 and redis.call('HSETNX', KEYS[2], 'b', ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[3], 'paid_tokens', ARGV[2])
  redis.call('HINCRBY', KEYS[3], 'batch_held', ARGV[2])
  redis.call('SADD', KEYS[4], ARGV[1])
  held = 1
end
if ARGV[4] == '1' then settle(KEYS[5], KEYS[6], KEYS[7], ARGV[1], ARGV[3]) end
if redis.call('GET', KEYS[8]) == ARGV[3] then redis.call('DEL', KEYS[8]) end
return held
"""

# A provider batch's prompt gives back what it held against the budget (it went back to its queue,
# or failed): the mark "b" PREPAY set and its tokens out of paid_tokens, once. KEYS: the key's marks,
# dataset totals, paid keys; ARGV: key.
BATCH_UNHOLD = """
local v = redis.call('HGET', KEYS[1], 'b')
if not v then return 0 end
redis.call('HDEL', KEYS[1], 'b')
redis.call('HINCRBY', KEYS[2], 'paid_tokens', -tonumber(v))
redis.call('HINCRBY', KEYS[2], 'batch_held', -tonumber(v))
if redis.call('HLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[3], ARGV[1]) end
return 1
"""

# The reconciler's rebuild of paid_tokens: the sum over the marks of keys not counted; the marks
# of counted keys (a twin marked a turn after the count) are dropped. Atomic: no worker's mark or
# count can fall between the sum and the write.
REBUILD_PAID = """
local total, held = 0, 0
for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local h = ARGV[1] .. k
  if redis.call('SISMEMBER', KEYS[2], k) == 1 or redis.call('EXISTS', h) == 0 then
    redis.call('DEL', h)
    redis.call('SREM', KEYS[1], k)
  else
    for _, v in ipairs(redis.call('HVALS', h)) do total = total + tonumber(v) end
    held = held + tonumber(redis.call('HGET', h, 'b') or '0')
  end
end
local have = tonumber(redis.call('HGET', KEYS[3], 'paid_tokens') or '0')
if have ~= total then redis.call('HSET', KEYS[3], 'paid_tokens', total) end
if tonumber(redis.call('HGET', KEYS[3], 'batch_held') or '0') ~= held then redis.call('HSET', KEYS[3], 'batch_held', held) end
return total - have
"""


# After Redis lost its data: a reservation again for a key a running task holds (its claim, put back
# by its worker's heartbeat) that has none and is not counted, so that a rebuilt budget sees it: the
# most the task can make (its max_tokens x turns left), never less than it was granted.
RESTORE = SETTLE + """
local tok = redis.call('GET', ARGV[4] .. ARGV[1])
if not tok or redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 1 then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. tok)
add(KEYS[3], tonumber(ARGV[2]))
local ttl = redis.call('PTTL', ARGV[4] .. ARGV[1])
redis.call('ZADD', KEYS[2], now + ((ttl > 0) and ttl or tonumber(ARGV[5])), ARGV[1])
return 1
"""

RELEASE = SETTLE + "return settle(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])"

# The reconciler's full pass, before it counts the store: bury (as admission's due pass does) the
# reservation of ARGV[1] if the claim it was taken under is gone (checked here, atomically): the key
# unclaimed, or claimed by another copy. KEYS: reservations, due index, reserved total, buried.
BURY_DEAD = SETTLE + """
local c, tok = parse(redis.call('HGET', KEYS[1], ARGV[1]))
if not c or tok == '' or redis.call('GET', ARGV[2] .. ARGV[1]) == tok then return 0 end
local t = redis.call('TIME')
bury(KEYS[1], KEYS[2], KEYS[4], ARGV[1], c, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
return 1
"""

# After a pass over the store counted every answer it holds: the reservations buried before the pass
# began (score <= ARGV[1]) and still buried go (those of stored answers were settled by their count).
# KEYS: reservations, due index, reserved total, buried. Returns how many went.
SETTLE_DEAD = SETTLE + """
local n = 0
for _, k in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ARGV[1])) do
  local c, tok = parse(redis.call('HGET', KEYS[1], k))
  if c and tok == '' then
    redis.call('HDEL', KEYS[1], k)
    redis.call('ZREM', KEYS[2], k)
    add(KEYS[3], -c)
    n = n + 1
  end
  redis.call('ZREM', KEYS[4], k)
end
return n
"""

# Admission. One rule (ledger.py): a task reserves the most it can make, its max_tokens (x the
# turns it has left); where less than that is left, exactly what is left, and it is asked with that
# as its max_tokens, so no answer can run past the budget. Nothing is guessed: no running mean,
# no margin, no closing round. The due pass drops the reservations whose claim is gone (their
# worker died) and looks again at the live ones a claim TTL later.
# KEYS: 1 dataset totals, 2 reservations, 3 closed, 4 due index, 5 reserved total, 6 rk.BUDGETS,
# 7 rk.COUNTERS_BUILT. ARGV: 1 key (a lease's name), 2 the caller's budget (the published one
# wins), 3 the task's max_tokens x turns left (a lease: one slot's), 4 claim key prefix,
# 5 RECHECK_MS, 6 EXPIRE_BATCH, 7 dataset, 8 claim token, 9 FLOOR_FRACTION (near the end, at least
# budget / it is granted, never more than the task asks: ``floor_tokens``), then the claim's TTL in seconds and a lease's slots (CLAIM_ADMIT, LEASE).
# admit() returns the verdict, the tokens granted, and the budget as published (the string).
_ADMIT_BODY = """
local claim_ttl_ms = nil  -- the key's claim TTL when the caller has just set it (CLAIM_ADMIT, LEASE)
local lease_slots = nil  -- LEASE: the slots asked for
local function admit()
local res, due, agg = KEYS[2], KEYS[4], KEYS[5]
local flags = redis.call('MGET', KEYS[3], KEYS[7])
if flags[1] then return -1, 0, '' end  -- closed
if not flags[2] then return -2, 0, '' end  -- counters not rebuilt from the store since Redis lost them
local want = tonumber(ARGV[3])
-- the budget enqueue published last (assign.py, rk.BUDGETS) wins over the caller's, a second old
local live = redis.call('HGET', KEYS[6], ARGV[7])
local budget, whole = tonumber(ARGV[2]), false
if live then
  if live == 'none' then return 1, want, live end  -- no budget any more: nothing to reserve against
  local b, rule = string.match(live, '^(%d+)%s*(%a*)$')
  if b then budget = tonumber(b) whole = rule == 'whole' end
end
local f = redis.call('HMGET', KEYS[1], @BUDGET_FIELDS@)
local committed = 0
for i = 1, #f do committed = committed + tonumber(f[i] or '0') end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- only the due reservations: drop those whose claim lapsed or passed to another copy (their worker
-- died, or was cut off for longer than a claim TTL), look again at the rest a claim TTL later
for _, k in ipairs(redis.call('ZRANGEBYSCORE', due, '-inf', now, 'LIMIT', 0, tonumber(ARGV[6]))) do
  local c, tok = parse(redis.call('HGET', res, k))
  if not c then
    redis.call('ZREM', due, k)  -- settled meanwhile: nothing left to look at
  elseif redis.call('GET', ARGV[4] .. k) ~= tok then
    bury(res, due, KEYS[8], k, c, now)  -- held until the store is counted (a lease's set of keys taken out expires)
  else
    local ttl = redis.call('PTTL', ARGV[4] .. k)
    redis.call('ZADD', due, now + ((ttl > 0) and ttl or tonumber(ARGV[5])), k)
  end
end
local reserved = tonumber(redis.call('HGET', agg, 'r') or '0')
local room = budget - committed - reserved
local grant = 0
if lease_slots then
  -- a lease: as many slots of ``want`` as fit in half the room, so that other workers find room too
  if whole then return 1, 0, live end
  local n = math.min(lease_slots, math.floor(room / (2 * want)))
  if n < 2 then return -4, 0, live or '' end
  grant = n * want
elseif room >= want or (whole and room > 0) then
  grant = want  -- whole answers: over by at most one answer's max_tokens, only where the dataset says so
elseif room >= math.max(1, math.min(want, math.floor(budget / tonumber(ARGV[9])))) then
  grant = room  -- the last stretch: asked with what is left as its max_tokens
end
if grant == 0 then
  -- what is in flight may come in short: wait for it (and say how much of it is buried: a pass over
  -- the store frees what stored nothing)
  if reserved > 0 then return 2, 0, live or '', redis.call('ZCARD', KEYS[8]) end
  -- so are the prompts of open provider batches (held in paid_tokens, their share batch_held)
  if tonumber(redis.call('HGET', KEYS[1], 'batch_held') or '0') > 0 then return 2, 0, live or '', 0 end
  redis.call('SET', KEYS[3], budget)  -- nothing in flight and less than the floor left: full
  return 0, 0, live or ''
end
-- the key's earlier entry (a copy before this one, buried or not) is taken over: the larger of the
-- two stays reserved, for that copy may have stored an answer the count of which is still to come
local old = parse(redis.call('HGET', res, ARGV[1])) or 0
redis.call('HSET', res, ARGV[1], math.max(old, grant) .. ':' .. ARGV[8])
add(agg, math.max(old, grant) - old)
redis.call('ZREM', KEYS[8], ARGV[1])
local ttl = claim_ttl_ms or redis.call('PTTL', ARGV[4] .. ARGV[1])
redis.call('ZADD', due, now + ((ttl > 0) and ttl or tonumber(ARGV[5])), ARGV[1])
return 1, grant, live or ''
end
""".replace("@BUDGET_FIELDS@", ", ".join(f"'{f}'" for f in BUDGET_FIELDS))

ADMIT = SETTLE + _ADMIT_BODY + """
local verdict, grant, live, buried = admit()
return {verdict, grant, live, buried or 0}
"""

# The claim and the admission in one step (one round trip where there were two): the key's claim
# under ARGV[8] (SET NX EX ARGV[10]), then admission as ADMIT; -3 when another task holds the claim
# (nothing reserved).
CLAIM_ADMIT = SETTLE + _ADMIT_BODY + """
if not redis.call('SET', ARGV[4] .. ARGV[1], ARGV[8], 'NX', 'EX', ARGV[10]) then return {-3, 0, ''} end
claim_ttl_ms = tonumber(ARGV[10]) * 1000
local verdict, grant, live, buried = admit()
return {verdict, grant, live, buried or 0}
"""

# A worker's lease of a dataset's budget (workers/leases.py): the claim of the lease's name ARGV[1]
# under ARGV[8] (SET NX EX ARGV[10]), then up to ARGV[11] slots of ARGV[3] tokens each (its tasks'
# max_tokens) reserved as one reservation under that name, in one step with admission's due pass.
# Returns {verdict, slots granted, the budget as published}: -4 when fewer than two slots fit,
# CLOSED and LOST as admission answers them, ADMITTED with no slots when the budget was removed
# or follows the whole-answers rule; whenever nothing is granted, the claim is let go in the step.
LEASE = SETTLE + _ADMIT_BODY + """
if not redis.call('SET', ARGV[4] .. ARGV[1], ARGV[8], 'NX', 'EX', ARGV[10]) then return {-3, 0, ''} end
claim_ttl_ms = tonumber(ARGV[10]) * 1000
lease_slots = tonumber(ARGV[11])
local verdict, grant, live = admit()
local slots = 0
if verdict == 1 and grant > 0 then slots = grant / tonumber(ARGV[3]) end
if slots == 0 then redis.call('DEL', ARGV[4] .. ARGV[1]) end
return {verdict, slots, live}
"""

# Slots of a lease its worker will not use (it expired, the worker stops): ARGV[2] tokens out of
# the lease ARGV[1], only while it is the one taken under the claim token ARGV[3] (claim key
# prefix ARGV[4], lease-taken prefix ARGV[5]); spent, its claim goes too. Returns 1 when it took them out.
LEASE_RETURN = SETTLE + """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v or string.sub(v, -#ARGV[3] - 1) ~= ':' .. ARGV[3] then return 0 end
if not shrink(KEYS[1], KEYS[2], KEYS[3], ARGV[1], v, tonumber(ARGV[2]), ARGV[4], ARGV[5] .. ARGV[1]) then return 0 end
return 1
"""

# A spend cap, by the budget's rule in dollars: before a paid request, hold the most it can cost (its
# prompt's worst case, ARGV[3] micro-USD, plus ARGV[4] micro-USD per output token x its max_tokens
# ARGV[5]); admitted while spent + held + that fit in the cap ARGV[6]; where less is left but at
# least the floor ARGV[7], with the max_tokens that fit (the request is asked with it). The hold
# ARGV[1] belongs to the task's claim token ARGV[2]. KEYS: 1 the backend's spend, 2 its holds,
# 3 their total, 4 rk.COUNTERS_BUILT. Returns {verdict, max_tokens, micro-USD held}: 1 held, 2 wait
# (what is in flight may cost less), 0 the cap is reached, -2 the counters are not the store's.
SPEND_HOLD = """
if redis.call('EXISTS', KEYS[4]) == 0 then return {-2, 0, 0} end
local spent = tonumber(redis.call('HGET', KEYS[1], 'cost_micro_usd') or '0')
local held = tonumber(redis.call('HGET', KEYS[3], 'r') or '0')
local room = tonumber(ARGV[6]) - spent - held
local pin, per, want = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local tokens = want
if pin + per * want > room then
  tokens = 0
  if per > 0 then tokens = math.floor((room - pin) / per) end
  if room < tonumber(ARGV[7]) or tokens < 1 then
    if held > 0 then return {2, 0, 0} end
    return {0, 0, 0}
  end
end
local hold = math.ceil(pin + per * tokens)
redis.call('HSET', KEYS[2], ARGV[1], hold .. ':' .. ARGV[2])
redis.call('HINCRBY', KEYS[3], 'r', hold)
return {1, tokens, hold}
"""

# A hold let go, once the request's cost is in the spend (counted, charged or prepaid) or it was
# never billed: only under its own token. KEYS: holds, their total; ARGV: hold id, token.
SPEND_RELEASE = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local c, tok = string.match(v, '^(%d+):(.*)$')
if tok ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HINCRBY', KEYS[2], 'r', -tonumber(c)) <= 0 then redis.call('DEL', KEYS[2]) end
return 1
"""

# The hold of a request whose task died with its cost unknown (the reconciler, after it kept the
# charge in the store): the held amount into the spend once, by the charge's id, and the hold gone,
# in one step, so spent + held never drops. KEYS: rk.CHARGED, spend, holds, their total; ARGV:
# charge id, micro-USD, hold id, token.
SPEND_LOSE = """
local v = redis.call('HGET', KEYS[3], ARGV[3])
if not v then return 0 end
local c, tok = string.match(v, '^(%d+):(.*)$')
if tok ~= ARGV[4] then return 0 end
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then redis.call('HINCRBY', KEYS[2], 'cost_micro_usd', ARGV[2]) end
redis.call('HDEL', KEYS[3], ARGV[3])
if redis.call('HINCRBY', KEYS[4], 'r', -tonumber(c)) <= 0 then redis.call('DEL', KEYS[4]) end
return 1
"""

# A hold made again as it was (a provider batch's request, from its record in the store, after Redis
# lost its holds): no admission, once by its id. KEYS: holds, their total; ARGV: hold id, micro, token.
SPEND_REHOLD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2] .. ':' .. ARGV[3]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], 'r', ARGV[2])
return 1
"""

# A charge (a paid generation no record carries) into its backend's spend once, by its id.
CHARGE = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], 'cost_micro_usd', ARGV[2])
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
