"""``draftfleet worker reconciler``: the periodic reconcile task, run by Celery beat.

One small worker with an embedded beat runs ``draftfleet.reconcile`` every ``interval_s`` on
its own queue, and serves the fleet's Prometheus metrics. Run one per fleet; a second one is
harmless (a pass only counts missing keys idempotently and corrects drift with increments).
"""

from __future__ import annotations

import logging
import socket
import tempfile
from hashlib import sha256
from pathlib import Path

from draftfleet import redis_keys as rk
from draftfleet.assign import live_budgets
from draftfleet.broker import connect, redact, resolve_redis_url
from draftfleet.reconcile import Reconciler, ensure_counters
from draftfleet.schemas.config import FleetConfig
from draftfleet.store import make_dirs, open_store
from draftfleet.views.redis_load import BUSY_SHARE, redis_load
from draftfleet.workers.app import make_app
from draftfleet.workers.worker import setup_logging

log = logging.getLogger("draftfleet.reconciler")

RECONCILE_TASK = "draftfleet.reconcile"
RECONCILE_QUEUE = rk.QUEUE_PREFIX + "_reconcile"


def run_reconciler(cfg: FleetConfig, *, redis_url: str | None = None, interval_s: float = 60.0,
                   metrics_port: int | None = None, metrics_address: str = "127.0.0.1", loglevel: str = "INFO") -> None:
    setup_logging(loglevel)
    url = resolve_redis_url(redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    r = connect(url)
    reconciler = Reconciler(open_store(cfg), r)
    app = make_app(url, cfg.fleet.visibility_timeout_s)
    app.conf.worker_consumer = "draftfleet.workers.consumer:Consumer"  # only fleet tasks run; others dead-lettered

    @app.task(name=RECONCILE_TASK, ignore_result=True, acks_late=False)
    def reconcile():
        # counters Redis lost are rebuilt from the store first, unless a worker is at it already
        ensure_counters(reconciler.store, r, wait=False)
        load = redis_load(r)  # a reading each pass, so that status measures the Redis over a recent window
        if load is not None and not load.since_start and load.cpu_share >= BUSY_SHARE:
            log.warning("the shared Redis used %.0f%% of a core over the last %.0f s: near saturation, more GPUs "
                        "will not go faster (ops/scaling.md, section 1)", 100 * load.cpu_share, load.window_s)
        # the datasets as they are now: also those enqueued since this process started
        for drift in reconciler.reconcile_all(list(live_budgets(cfg, r))):
            lost = drift.newly_counted - drift.newly_in_flight  # (claimed ones were about to be counted)
            if drift.corrections or lost or drift.counted_not_stored or drift.unreadable:
                log.warning("%s: drift corrected %s; %d stored keys were uncounted; %d counted keys missing from "
                            "the store; %d unreadable records", drift.dataset, drift.corrections, lost,
                            drift.counted_not_stored, len(drift.unreadable))
            if drift.set_aside:
                log.warning("%s: %d record files could not be read and were set aside (%s ...): `draftfleet "
                            "enqueue` generates them again", drift.dataset, len(drift.set_aside), drift.set_aside[0])
            if drift.paid_turns_marked or drift.paid_tokens_corrected:
                log.warning("%s: %d kept turns of unstored conversations counted as paid again; paid tokens "
                            "corrected by %+d", drift.dataset, drift.paid_turns_marked, drift.paid_tokens_corrected)
            if drift.stale_reservations:
                log.info("%s: freed %d reservations of dead tasks (the store counted)", drift.dataset, drift.stale_reservations)

    app.conf.beat_schedule = {
        "reconcile": {"task": RECONCILE_TASK, "schedule": interval_s,
                      "options": {"queue": RECONCILE_QUEUE, "expires": interval_s}},
    }
    if metrics_port is not None:
        from prometheus_client import REGISTRY, start_http_server

        from draftfleet.views.metrics import FleetCollector

        REGISTRY.register(FleetCollector(cfg, r))
        start_http_server(metrics_port, addr=metrics_address)
        log.info("metrics on http://%s:%d/metrics", metrics_address, metrics_port)
    store = open_store(cfg)
    # celery beat's schedule: the store's folder, else (a bucket) this machine's temp folder
    local = store.root if store.local else Path(tempfile.gettempdir()) / f"draftfleet-{sha256(store.location.encode()).hexdigest()[:12]}"
    state = local / "_state"
    make_dirs(state)
    log.info("reconciler every %.0fs, broker %s", interval_s, redact(url))
    app.worker_main([
        "worker", "-B", "-s", str(state / "celerybeat-schedule"), "-P", "threads", "-c", "1",
        "-Q", RECONCILE_QUEUE, "-n", f"reconciler@{socket.gethostname()}", "-l", loglevel.upper(),
        "--without-gossip", "--without-mingle",
    ])
