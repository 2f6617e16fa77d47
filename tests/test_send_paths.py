"""The fast paths the benchmarks led to give exactly what the plain paths give.

``TaskSender`` (enqueue's batched publisher) must produce the message and the task-sent event
that Celery's ``send_task`` produces, so workers and Flower cannot tell them apart; and
``completion_ids_batch`` must give the ids ``completion_ids`` gives, one answer at a time.
"""

from __future__ import annotations

import base64
import json

from draftfleet import redis_keys as rk
from draftfleet.producer.enqueue import PUBLISH_BATCH, TaskSender
from draftfleet.schemas.records import Message
from draftfleet.workers.app import make_app


def _envelope(raw: bytes) -> tuple[dict, object]:
    msg = json.loads(raw)
    body = json.loads(base64.b64decode(msg.pop("body")))
    msg["properties"].pop("delivery_tag")
    return msg, body


def test_task_sender_sends_what_send_task_sends(redis_server):
    app = make_app(redis_server.url, 3600)
    r = redis_server.client()
    events = r.pubsub()
    events.psubscribe("*celeryev*")
    events.get_message(timeout=1)
    queue, key, payload = rk.queue("ds"), "a" * 64, {"key": "a" * 64, "messages": [{"role": "user", "content": "hi"}]}
    with app.producer_or_acquire() as producer:
        app.send_task(rk.TASK_NAME, args=[payload], queue=queue, task_id=key, producer=producer, argsrepr="['f:1']")
    with app.producer_or_acquire() as producer, producer.batch(max_size=PUBLISH_BATCH):
        TaskSender(app, producer, queue).send(key, payload, argsrepr="['f:1']")
    old, new = (_envelope(raw) for raw in reversed(r.lrange(queue, 0, -1)))
    # send_task also copies argsrepr/kwargsrepr into the properties (its options leak there).
    for k in ("argsrepr", "kwargsrepr"):
        old[0]["properties"].pop(k, None)
    assert new == old
    assert new[0]["headers"]["id"] == key and new[1][0] == [payload]

    sent = []
    while (m := events.get_message(timeout=1)) is not None:
        if m["type"] == "pmessage":
            sent.append(json.loads(m["data"]))
    assert len(sent) == 2
    for ev in sent:
        ev.pop("properties")
        ev["body"] = json.loads(base64.b64decode(ev["body"]))
        for k in ("clock", "timestamp"):
            ev["body"].pop(k)
    assert sent[0] == sent[1]
    assert sent[0]["body"]["type"] == "task-sent" and sent[0]["body"]["uuid"] == key
    app.close()


def test_completion_ids_batch_gives_the_same_ids(target_tokenizer):
    user = [Message("user", "write a sort")]
    answers = [
        (user, "def f(): return 1", None, True),
        (user, "a literal <|im_end|> stays text", "think first", True),
        (user, "cut off mid", None, False),
        ([Message("system", "be brief"), *user], "", "only reasoning", True),
    ]
    assert target_tokenizer.completion_ids_batch(answers) == [target_tokenizer.completion_ids(*a) for a in answers]
    assert target_tokenizer.completion_ids_batch([]) == []
