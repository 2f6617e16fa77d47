"""The Celery app: Redis broker, JSON only, late acks, one message per slot.

Delivery is at-least-once. The settings below make a lost worker cost a redelivery, never a lost
prompt; idempotency (one result per key) is ours, in the store and the claim.
"""

from __future__ import annotations

from celery import Celery

from draftfleet import redis_keys as rk


def make_app(broker_url: str, visibility_timeout_s: int) -> Celery:
    app = Celery("draftfleet", broker=broker_url, set_as_current=False)
    transport = {
        # Counts from reservation, not from task start: it must exceed the longest a task can hold
        # its message (the config checks that). Older unacked messages are redelivered to any
        # worker, also while the first still runs them (celery#5935): the claim covers that.
        "visibility_timeout": visibility_timeout_s,
        "socket_keepalive": True,
        "health_check_interval": 25,
    }
    app.conf.update(
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        # An error reply from Redis to the consumer (a failover's "UNBLOCKED ... master -> replica", a
        # server restarting or out of memory) is a channel error to Celery, not a connection error: by
        # default "Unrecoverable error", and the worker stopped consuming for good (celery#7946).
        # Reconnect instead, as for a lost connection.
        broker_channel_error_retry=True,
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],  # never pickle
        result_accept_content=["json"],
        task_ignore_result=True,  # the store is the result
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # A connection blip requeues every unacked message, and Celery then will not ack the tasks
        # still running. It tries to cancel them here, but the threads pool cannot ("does not
        # implement kill_job", logged): they run on and store their result, and what keeps their
        # requeued copies from running twice is the claim, which the heartbeat re-creates if Redis
        # lost it. Kept on for the pools that can cancel, and for Celery 6's default.
        worker_cancel_long_running_tasks_on_connection_loss=True,
        task_create_missing_queues=True,
        task_default_queue=rk.QUEUE_PREFIX + "default",
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        broker_pool_limit=16,
    )
    return app
