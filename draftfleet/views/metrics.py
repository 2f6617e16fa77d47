"""The fleet's own Prometheus metrics, served by the reconciler (Flower's have no queue depth).

A collector reads a status snapshot on every scrape, so the figures are as fresh as Redis:
tokens, responses and cost per dataset and backend, queue depth, in flight, budget (and what it has
spent and left, as admission counts them), retries and failures by reason, spend per cloud
backend, worker counts by kind, each backend's tokens/s, the plan (plan.py): tokens left, the time and money to finish on each side, the ETA, stalled; and the open provider batches.
``ops/grafana/draftfleet.json`` is a dashboard of these (every expression checked against a scrape
by ``tests/test_metrics.py``).
"""

from __future__ import annotations

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from draftfleet.ledger import Ledger
from draftfleet.schemas.config import FleetConfig
from draftfleet.views.status import snapshot


class FleetCollector:
    def __init__(self, cfg: FleetConfig, r: redis.Redis):
        self.cfg = cfg
        self.r = r

    def collect(self):
        snap = snapshot(self.cfg, self.r)
        ledger = Ledger(self.r)
        tokens = CounterMetricFamily("draftfleet_completion_tokens", "Completion tokens stored", labels=["dataset", "backend"])
        responses = CounterMetricFamily("draftfleet_responses", "Responses stored", labels=["dataset", "backend"])
        cost = CounterMetricFamily("draftfleet_cost_usd", "Cost of stored responses (USD)", labels=["dataset", "backend"])
        depth = GaugeMetricFamily("draftfleet_queue_depth", "Tasks waiting in the dataset's queue", labels=["dataset"])
        inflight = GaugeMetricFamily("draftfleet_inflight", "Tasks being generated now", labels=["dataset"])
        budget = GaugeMetricFamily("draftfleet_budget_tokens", "Token budget of the dataset", labels=["dataset"])
        spent = GaugeMetricFamily("draftfleet_budget_spent_tokens", "Tokens the budget has spent, as admission counts "
                                  "them: stored records and paid turns of conversations not stored yet",
                                  labels=["dataset"])
        left = GaugeMetricFamily("draftfleet_budget_left_tokens", "Tokens left in the budget (admission refuses "
                                 "a prompt once less than it reserves is left)", labels=["dataset"])
        events = CounterMetricFamily("draftfleet_events", "Retries, failures and skips by reason", labels=["dataset", "event"])
        spend = GaugeMetricFamily("draftfleet_spend_usd", "Spend of a cloud backend (USD)", labels=["backend"])
        cap = GaugeMetricFamily("draftfleet_spend_cap_usd", "max_spend_usd of a cloud backend", labels=["backend"])
        workers = GaugeMetricFamily("draftfleet_workers", "Live workers", labels=["kind", "state"])
        tps = GaugeMetricFamily("draftfleet_backend_tokens_per_second", "Completion tokens/s of a backend on a dataset, "
                                "over the window (1m, 10m, or the run's age if shorter)", labels=["dataset", "backend", "window"])
        remaining = GaugeMetricFamily("draftfleet_plan_remaining_tokens", "Tokens left to generate (budget or prompts, "
                                      "whichever runs out first)", labels=["dataset"])
        finish_s = GaugeMetricFamily("draftfleet_plan_time_to_finish_seconds", "Time to finish the dataset on one side "
                                     "at its measured rate (side 'all at once': every measured side)",
                                     labels=["dataset", "side", "kind"])
        finish_usd = GaugeMetricFamily("draftfleet_plan_cost_to_finish_usd", "Money to finish the dataset on one side "
                                       "(measured or configured price; 0 on GPUs)", labels=["dataset", "side", "kind"])
        eta = GaugeMetricFamily("draftfleet_eta_seconds", "ETA from the live workers of the assigned kinds", labels=["dataset"])
        stalled = GaugeMetricFamily("draftfleet_stalled", "1 when work is left but no live worker of an assigned kind "
                                    "takes the dataset", labels=["dataset"])
        redis_cpu = GaugeMetricFamily("draftfleet_redis_cpu_share", "Share of one core the shared Redis used lately "
                                      "(it runs commands on one thread: near 1, the fleet stops scaling)")
        if snap.redis is not None:
            redis_cpu.add_metric([], snap.redis.cpu_share)
        batches = GaugeMetricFamily("draftfleet_batches_open", "Open provider batches (draftfleet worker batch)",
                                    labels=["dataset", "backend"])
        batch_prompts = GaugeMetricFamily("draftfleet_batch_prompts", "Prompts of the open provider batches, by the "
                                          "provider's count (state: submitted, completed, failed)",
                                          labels=["dataset", "backend", "state"])
        open_by: dict[tuple[str, str], list] = {}
        for b in snap.batches:
            open_by.setdefault((b.dataset, b.backend), []).append(b)
        for (dataset, backend), group in sorted(open_by.items()):
            batches.add_metric([dataset, backend], len(group))
            for state, n in (("submitted", sum(b.prompts for b in group)), ("completed", sum(b.completed for b in group)),
                             ("failed", sum(b.failed for b in group))):
                batch_prompts.add_metric([dataset, backend, state], n)
        for d in snap.datasets:
            for b in d.backends:
                tps.add_metric([d.dataset, b.backend, "1m"], b.tps_1m)
                tps.add_metric([d.dataset, b.backend, "10m"], b.tps_10m)
        for p in snap.plans:
            if p.remaining_tokens is not None:
                remaining.add_metric([p.dataset], p.remaining_tokens)
            for side in p.sides + ([p.at_once] if p.at_once else []):
                if side.time_s is not None:
                    finish_s.add_metric([p.dataset, side.backend, side.kind], side.time_s)
                if side.cost_usd is not None:
                    finish_usd.add_metric([p.dataset, side.backend, side.kind], side.cost_usd)
            if p.eta_s is not None:
                eta.add_metric([p.dataset], p.eta_s)
            stalled.add_metric([p.dataset], 1 if p.stalled else 0)
        for d in snap.datasets:
            for b in d.backends:
                tokens.add_metric([d.dataset, b.backend], b.completion_tokens)
                responses.add_metric([d.dataset, b.backend], b.responses)
                cost.add_metric([d.dataset, b.backend], b.cost_usd)
            depth.add_metric([d.dataset], d.queue_depth)
            inflight.add_metric([d.dataset], d.inflight)
            if d.budget_tokens:
                budget.add_metric([d.dataset], d.budget_tokens)
            if d.budget is not None:
                spent.add_metric([d.dataset], d.budget.spent_tokens)
                left.add_metric([d.dataset], d.budget.left_tokens)
            for name, n in sorted(ledger.events(d.dataset).items()):
                events.add_metric([d.dataset, name], n)
        for s in snap.spend:
            spend.add_metric([s.backend], s.spent_usd)
            if s.cap_usd is not None:
                cap.add_metric([s.backend], s.cap_usd)
        counts: dict[tuple[str, str], int] = {}
        for w in snap.workers:
            key = (w.kind, "paused" if w.paused else "running")
            counts[key] = counts.get(key, 0) + 1
        for (kind, state), n in sorted(counts.items()):
            workers.add_metric([kind, state], n)
        yield from (tokens, responses, cost, depth, inflight, budget, spent, left, events, spend, cap, workers, tps, remaining,
                    finish_s, finish_usd, eta, stalled, redis_cpu, batches, batch_prompts)
