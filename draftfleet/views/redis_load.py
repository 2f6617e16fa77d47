"""How busy the one Redis the fleet shares is: the share of a core it used lately.

Redis runs commands on one thread, so the fleet stops scaling where that thread is full, and the
sign is plain: redis-server's CPU near one second a second while engines report idle slots
(ops/scaling.md §1). ``INFO cpu`` gives the CPU used since Redis started; the share over a recent
window needs a second reading, so each reading is kept in Redis (``rk.REDIS_CPU``) and the next
reader (``status``, a metrics scrape, the reconciler's pass) measures the share since. Without a
usable reading (the first call, a restarted Redis), the share is the average since Redis started.
"""

from __future__ import annotations

import msgspec
import redis

from draftfleet import redis_keys as rk

# A reading younger than this is too short a window to measure: the one before it is used.
MIN_WINDOW_S = 5.0
# Past this a reading is too old to say "lately": it is replaced, and the share is measured over it once.
KEEP_S = 60.0
# From here on status says the Redis is near saturation.
BUSY_SHARE = 0.7


class RedisLoad(msgspec.Struct, kw_only=True):
    cpu_share: float  # of one core, over window_s
    window_s: float
    since_start: bool  # no recent reading: the average since Redis started
    ops_per_s: int  # Redis's own recent commands/s (INFO instantaneous_ops_per_sec)


def redis_load(r: redis.Redis) -> RedisLoad | None:
    """The share of a core Redis used over the last minute or so (None if Redis hides INFO)."""
    try:
        info = r.info()
        seen = r.hgetall(rk.REDIS_CPU)
    except redis.ResponseError:  # INFO disabled (a managed Redis): nothing to say
        return None
    cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    now, run_id = float(info["uptime_in_seconds"]), str(info["run_id"])
    ops = int(info.get("instantaneous_ops_per_sec", 0))
    last = {k.decode(): v.decode() for k, v in seen.items()}
    same = last.get("run_id") == run_id
    window = now - float(last["at"]) if same else 0.0
    if not same or window >= KEEP_S:
        r.hset(rk.REDIS_CPU, mapping={"run_id": run_id, "at": now, "cpu": cpu})
    if same and window >= MIN_WINDOW_S:
        return RedisLoad(cpu_share=round((cpu - float(last["cpu"])) / window, 3), window_s=round(window, 1),
                         since_start=False, ops_per_s=ops)
    return RedisLoad(cpu_share=round(cpu / max(1.0, now), 3), window_s=now, since_start=True, ops_per_s=ops)
