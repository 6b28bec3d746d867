"""The Lua scripts of the Redis backend (`redis_backend.py`): each runs atomically on the server.

Put with dedupe and the lease's credit, all-or-nothing batch claims, admission with the task
cursor, and the producer leases (renew, reap the lapsed, give back).
"""

# Leases. KEYS (after the script's own): state, leases, held, lapsed. `REAP` moves the credits of
# every lease past its deadline back out of `started`; `touch` refuses a lapsed lease (-1) or
# renews it. ARGV of the caller: ..., lease, ttl_ms.
NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
REAP = """
local function reap(state, leases, held, lapsed)
  for _, l in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now)) do
    local c = tonumber(redis.call('HGET', held, l) or 0)
    redis.call('HINCRBY', state, 'started', 0 - c)
    redis.call('HINCRBY', state, 'admission_reclaimed', c)
    redis.call('HINCRBY', state, 'leases_lapsed', 1)
    redis.call('HDEL', held, l)
    redis.call('ZREM', leases, l)
    redis.call('SADD', lapsed, l)
  end
end
local function touch(leases, lapsed, lease, ttl)
  if redis.call('SISMEMBER', lapsed, lease) == 1 then return -1 end
  redis.call('ZADD', leases, now + tonumber(ttl), lease)
  return 1
end
"""

PING = (
    NOW
    + REAP
    + """
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return touch(KEYS[2], KEYS[4], ARGV[1], ARGV[2])
"""
)

REAP_ONLY = (
    NOW
    + REAP
    + """
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return 1
"""
)

BYE = """
local c = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or 0)
redis.call('HINCRBY', KEYS[1], 'started', 0 - c)
redis.call('HINCRBY', KEYS[1], 'admission_released', c)
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return c
"""

RELEASE = (
    NOW
    + REAP
    + """
if touch(KEYS[2], KEYS[4], ARGV[2], ARGV[3]) < 0 then return -1 end
local c = math.min(tonumber(ARGV[1]), tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or 0))
redis.call('HINCRBY', KEYS[3], ARGV[2], 0 - c)
redis.call('HINCRBY', KEYS[1], 'started', 0 - c)
redis.call('HINCRBY', KEYS[1], 'admission_released', c)
return c
"""
)

# KEYS: stream, ids, state, leases, held, lapsed; ARGV: gid, minv, lens, data, lease, ttl_ms.
# -2: the run is over (the learner finished; not taken); -1: the lease lapsed (not taken);
# 0: a duplicate; 1: added. Either of the last spends a credit.
PUT = (
    NOW
    + REAP
    + """
if redis.call('HGET', KEYS[3], 'finished') == '1' then return -2 end
if touch(KEYS[4], KEYS[6], ARGV[5], ARGV[6]) < 0 then return -1 end
if tonumber(redis.call('HGET', KEYS[5], ARGV[5]) or 0) > 0 then
  redis.call('HINCRBY', KEYS[5], ARGV[5], -1)
  redis.call('HINCRBY', KEYS[3], 'admission_spent', 1)
else
  redis.call('HINCRBY', KEYS[3], 'put_unleased', 1)
end
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], '*', 'gid', ARGV[1], 'minv', ARGV[2], 'lens', ARGV[3], 'data', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'groups_in', 1)
redis.call('HINCRBY', KEYS[3], 'bytes_in', string.len(ARGV[4]))
return 1
"""
)

GIVE_BACK = """
for i = 2, #ARGV do
  local e = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  if #e > 0 then
    redis.call('XADD', KEYS[1], '*', unpack(e[1][2]))
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
  end
end
return 1
"""

# Claim exactly `need` entries for this consumer, or none: a rank never sits on part of a batch.
# (ARGV: group, consumer, need, count; count > need lets oldest_first choose among more.)
TAKE = """
local last = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local name, id
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then id = g[i + 1] end
  end
  if name == ARGV[1] then last = id end
end
if not last then return {} end
local ready = redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', ARGV[3])
if #ready < tonumber(ARGV[3]) then return {} end
return redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[4], 'STREAMS', KEYS[1], '>')
"""

# KEYS: state, leases, held, lapsed; ARGV: n, lease, ttl_ms. {granted, version, first task, k};
# granted -1: the lease lapsed; -2: the run is over (the learner finished).
ACQUIRE = (
    NOW
    + REAP
    + """
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4])
local s = redis.call('HMGET', KEYS[1], 'version', 'started', 'groups_per_step', 'max_staleness', 'finished')
if s[5] == '1' then return {-2, tonumber(s[1] or 0), -1, -1} end
if not s[3] then return {0, -1, -1, -1} end
local v, started, gps, k = tonumber(s[1] or 0), tonumber(s[2] or 0), tonumber(s[3]), tonumber(s[4])
if touch(KEYS[2], KEYS[4], ARGV[2], ARGV[3]) < 0 then return {-1, v, -1, k} end
if started + tonumber(ARGV[1]) <= (v + k + 1) * gps then
  redis.call('HINCRBY', KEYS[1], 'started', ARGV[1])
  redis.call('HINCRBY', KEYS[1], 'admitted', ARGV[1])
  redis.call('HINCRBY', KEYS[3], ARGV[2], ARGV[1])
  local tasks = redis.call('HINCRBY', KEYS[1], 'tasks', ARGV[1])
  return {1, v, tasks - tonumber(ARGV[1]), k}
end
return {0, v, -1, k}
"""
)
