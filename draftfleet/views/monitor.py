"""Flower for the fleet: the broker's live view of workers and tasks, behind basic auth.

Flower runs in this process on the fleet's own Celery app (never as ``celery flower --broker
URL --basic-auth=...``, whose argv anyone on the host can read with ``ps``). The credentials
come from an environment variable and the broker URL is only ever logged redacted. Checked
against Flower 2.x's source:

- ``--basic-auth`` guards the web pages and ``/api/*``; ``/metrics`` and ``/healthcheck`` are
  never authenticated (Prometheus text: worker, task and queue names and counts, no secrets),
  which is why the default address is loopback.
- With no auth at all Flower still closes ``/api/*`` unless ``FLOWER_UNAUTHENTICATED_API`` is
  set; its pages are open to anyone who reaches the port.
- Its control API (shutdown, pool, add/cancel consumer, revoke, apply/send task) is switched off
  here (Flower's ``read_only``) unless asked for: consumers changed behind ``draftfleet``'s back
  are forgotten on restart and ignore the dataset assignment kept in Redis.
- Flower keeps task history in memory only: its counts run from when it started, and a restart
  loses them (the lasting totals are the store's: ``draftfleet inventory``, ``status``, the
  reconciler's metrics); its ``/metrics`` has no queue depth (``draftfleet status`` reads Redis).
- A task's row shows ``args`` as the ``argsrepr`` enqueue gives it: the dataset and the prompt's
  ``file:line`` (its uuid is the key). ``rejected`` is formatted as a time (:func:`format_task`).
- Its broker tab (and ``/api/queues/length``) lists only the queues that live workers report
  consuming, falling back to the app's ``task_queues`` when it knows none
  (``BaseHandler.get_active_queue_names``; mher/flower#335, #559): a dataset nobody consumes, just
  enqueued or pivoted away, would vanish from it. Here both list every dataset's queue as well.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys

from draftfleet.broker import redact
from draftfleet.schemas.config import ConfigError, FleetConfig

log = logging.getLogger("draftfleet.flower")

AUTH_ENV = "FLOWER_BASIC_AUTH"


def format_task(task):
    """Flower's ``format_task`` hook: a task's ``rejected`` time as a date, like its other times.

    A fleet task is rejected (``Reject(requeue=True)``: a pause, a drain, a hand-back, admission
    waiting) and later succeeds on the same or another worker under the same id, so Flower's page
    shows both; its template formats only sent, received, started, succeeded, retried, failed and
    revoked as times, and printed ``rejected`` as a raw epoch (Flower 2.2's ``task.html``)."""
    from flower.utils.template import humanize

    if isinstance(getattr(task, "rejected", None), (int, float)):
        task.rejected = humanize(task.rejected, type="time") + " (rejected: given back to its queue)"
    return task


def basic_auth_from_env(name: str) -> list[str]:
    """The ``user:password`` pairs (comma-separated) held by environment variable ``name``.

    Errors name the variable, never its value.
    """
    raw = os.environ.get(name, "")
    if not raw.strip():
        raise ConfigError(
            f"Flower needs authentication: set {name}=user:password (several pairs separated by commas), "
            "or name another variable with --basic-auth-env; --no-auth runs it open to anyone who reaches the port"
        )
    pairs = [p.strip() for p in raw.split(",")]
    for i, pair in enumerate(pairs, 1):
        user, sep, password = pair.partition(":")
        if not (sep and user and password):
            raise ConfigError(f"{name}: entry {i} is not of the form user:password (user and password both non-empty)")
    return pairs


def _fleet_queue_views(cfg: FleetConfig):
    """Flower's broker page and queue-length API, listing every dataset queue besides the consumed ones.

    Datasets come from the config and from the store (one enqueued since Flower started has a
    manifest there), read on each request.
    """
    from flower.api.tasks import GetQueueLengths
    from flower.views.broker import BrokerView

    from draftfleet import redis_keys as rk
    from draftfleet.store import open_store

    store = open_store(cfg)

    class DatasetQueues:
        def get_active_queue_names(self):
            names = {d.name for d in cfg.datasets} | set(store.datasets())
            return sorted(set(super().get_active_queue_names()) | {rk.queue(n) for n in names})

    return (type("FleetBrokerView", (DatasetQueues, BrokerView), {}),
            type("FleetQueueLengths", (DatasetQueues, GetQueueLengths), {}))


def run_flower(
    cfg: FleetConfig,
    broker_url: str,
    *,
    basic_auth: list[str] | None,
    address: str = "127.0.0.1",
    port: int = 5555,
    allow_control: bool = False,
) -> None:
    """Serve Flower in the foreground until SIGTERM or Ctrl-C. ``basic_auth=None`` runs it open."""
    from flower.app import Flower
    from flower.command import extract_settings, setup_logging
    from flower.urls import settings
    from tornado.options import options

    from draftfleet.workers.app import make_app

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")
    # Set on Flower's own option object, as its command line would, but in memory: no argv, no
    # FLOWER_* environment parsing (an empty FLOWER_BASIC_AUTH would parse as one empty pair).
    options.address = address
    options.port = port
    options.basic_auth = list(basic_auth or [])
    options.read_only = not allow_control
    options.debug = False  # debug would log Flower's settings, cookie secret included
    options.format_task = format_task
    extract_settings()
    setup_logging()

    app = make_app(broker_url, cfg.fleet.visibility_timeout_s)
    flower_app = Flower(capp=app, options=options, **settings)
    # Rules added after construction are matched before Flower's own (tornado's Application.add_handlers).
    broker_view, queue_lengths = _fleet_queue_views(cfg)
    flower_app.add_handlers(r".*", [(r"/broker", broker_view), (r"/api/queues/length", queue_lengths)])
    atexit.register(flower_app.stop)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(0))
    bound = flower_app.start_http_server()
    if basic_auth:
        auth = f"basic auth, {len(basic_auth)} user(s)"
    else:
        auth = "NONE"
        log.warning("Flower runs WITHOUT authentication (--no-auth): anyone who reaches %s:%d sees the fleet", address, bound)
    log.info("Flower at http://%s:%d (%s, control %s), /metrics for Prometheus, broker %s",
             address, bound, auth, "allowed" if allow_control else "off (read only)", redact(broker_url))
    try:
        flower_app.start()
    except (KeyboardInterrupt, SystemExit):
        pass
