"""``draftfleet inventory`` and ``draftfleet reconcile``: what the store holds, and the counters rebuilt from it."""

from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table

from draftfleet.cli.common import (add_common, add_version, config_or_store, dataset_names, err, optional_tokenizer, out,
                                   redis_client)


def with_plans(args, cfg, inventory) -> list:
    """The inventories (``inventory(r)``) with their plans (the fleet's Redis for live figures, when it answers)."""
    import msgspec

    from draftfleet.cli.plan import fleet_redis, plans

    r = fleet_redis(args, cfg)
    invs = inventory(r)
    return [msgspec.structs.replace(inv, plan=p) for inv, p in zip(invs, plans(cfg, invs, r))]


def print_inventory(invs, store_alone: bool = False) -> None:
    from draftfleet.views.inventory import ROUNDTRIP_MEANING
    from draftfleet.views.plan import render_plans, usd

    for inv in invs:
        of = f"version {inv.version}" if inv.version is not None else "every version"
        # Two-line headers and folding names: the table fits 80 columns without cutting a header.
        table = Table(title=f"inventory: {inv.dataset} ({of})", title_justify="left", box=box.SIMPLE_HEAD,
                      pad_edge=False, padding=(0, 1), collapse_padding=True)
        for col in ("backend", "kind", "token\nsource", "responses", "completion\ntokens", "provider's\ncount",
                    "differ-\nence", "cost\n(USD)"):
            if col in ("backend", "kind", "token\nsource"):
                table.add_column(col, overflow="fold")
            else:
                table.add_column(col, justify="right", no_wrap=True)
        for s in inv.by_source:
            theirs = (f"{s.provider_completion_tokens:,}", f"{s.provider_difference:+,}") if s.provider_responses else ("-", "-")
            table.add_row(s.backend, s.backend_kind, s.token_source, f"{s.responses:,}", f"{s.completion_tokens:,}",
                          *theirs, usd(s.cost_usd))
        table.add_row("total", "", "", f"{inv.responses:,}", f"{inv.completion_tokens:,}", "", "", usd(inv.spend_usd))
        out.print(table)
        out.print("completion tokens: the target tokenizer's count (budgets use it); provider's count: the API's own "
                  "usage.completion_tokens (its tokenizer); difference: ours minus theirs", highlight=False)
        line = f"mean {inv.mean_tokens or 0:,.0f} tokens/response"
        if inv.conversations:
            line += f"; {inv.conversations:,} conversations, {inv.turns:,} regenerated turns in all"
        if inv.budget_tokens and inv.prompts_left is None:
            # The budget's share is no share done: the prompts may run out first, and they are not known here.
            why = "--store alone reads no dataset file" if store_alone else "the dataset file was not read"
            line += (f"; budget {inv.budget_tokens:,}, {inv.remaining_tokens:,} remaining; no % done: the prompts "
                     f"left are not known ({why}) and may run out before the budget")
        elif inv.budget_tokens:
            line += (f"; budget {inv.budget_tokens:,}: {100 * (inv.share_done or 0):.1f}% done, "
                     f"{inv.remaining_tokens:,} remaining")
        if inv.budget is not None and inv.budget.paid_tokens:
            line += f" ({inv.budget.paid_tokens:,} spent in paid turns of conversations not stored yet)"
        if inv.prompts_left is not None:
            line += f"; {inv.prompts_left:,} prompts left"
        for name, cost in inv.cost_to_finish_usd.items():
            line += f"; to finish on {name}: ~${usd(cost)}"
        if inv.other_versions:
            line += f"; {inv.other_versions:,} records of other versions not counted (--version, --all-versions)"
        out.print(line, highlight=False)
        v = inv.validation
        checks = [f"schema errors {v.schema_errors}", f"truncated {v.truncated}", f"duplicate prompts {v.duplicate_prompts}"]
        if v.ids_out_of_vocab is not None:
            checks += [f"ids out of vocab {v.ids_out_of_vocab}", f"stopped without end-of-turn {v.stop_without_eot}"]
        if v.roundtrip_mismatch_share is not None:
            checks.append(f"round-trip mismatch share {100 * v.roundtrip_mismatch_share:.1f}% "
                          f"({v.roundtrip_mismatched} of {v.roundtrip_checked} exact records)")
        out.print("validation: " + ", ".join(checks), highlight=False)
        if (h := inv.hidden_states) is not None:
            held = f" in {h.files:,} files" if h.files != h.turns else ""
            out.print(f"hidden states v{h.version} (layers {h.layer_ids}, {h.dtype}): {h.turns:,} of {h.units:,} turns "
                      f"captured{held}, {h.tokens:,} tokens, {h.bytes / 1e9:,.3f} GB ({h.bytes_per_token:,.0f} B/token); "
                      f"the rest and the budget left: about {h.projected_bytes / 1e9:,.2f} GB more", highlight=False)
            if h.verified is not None:
                out.print(f"  verified: {h.verified:,} files are as sealed when they were stored (header and tensors)"
                          + (f"; {h.unsealed:,} of a version made before seals carry none, not checked" if h.unsealed
                             else "")
                          + (f"; [red]{len(h.bad_files):,} changed or unreadable[/]" if h.bad_files else ""),
                          highlight=False)
            for why in h.bad_files:
                err.print(f"[red]error[/]: {escape(why)}", highlight=False)
        if v.roundtrip_mismatch_share is not None:
            out.print(f"  round-trip mismatch share: {ROUNDTRIP_MEANING}", highlight=False)
        for f in v.unreadable_files[:10]:
            out.print(f"  [yellow]unreadable[/] {escape(f)}", highlight=False)
        if inv.plan is not None:
            out.print(render_plans([inv.plan]))


def cmd_inventory(args) -> int:
    import msgspec

    from draftfleet.versions import VersionError
    from draftfleet.views.inventory import run_inventory

    cfg, root = config_or_store(args)
    try:
        invs = with_plans(args, cfg, lambda r: run_inventory(root, cfg, args.dataset, optional_tokenizer(args, cfg),
                                                             args.roundtrip_sample, version=args.version,
                                                             all_versions=args.all_versions, verify=args.verify, r=r))
    except VersionError as exc:
        err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
        return 1
    if args.json:
        print(msgspec.json.encode(invs).decode())
    else:
        print_inventory(invs, store_alone=cfg is None)
    return 1 if any(inv.hidden_states and inv.hidden_states.bad_files for inv in invs) else 0


def cmd_reconcile(args) -> int:
    import msgspec

    from draftfleet.reconcile import Reconciler
    from draftfleet.store import open_store

    cfg, root = config_or_store(args)
    store = open_store(cfg or root)
    names = dataset_names(args, cfg, root)
    drifts = Reconciler(store, redis_client(args, cfg)).reconcile_all(names)
    if args.json:
        print(msgspec.json.encode(drifts).decode())
        return 0
    table = Table(title="reconcile: counters against the store")
    for col in ("dataset", "stored", "counted", "newly counted", "corrections", "counted, not stored", "unreadable"):
        table.add_column(col, justify="left" if col in ("dataset", "corrections") else "right")
    for d in drifts:
        fixes = "; ".join(f"{b}: " + ", ".join(f"{k} {v:+d}" for k, v in c.items()) for b, c in d.corrections.items())
        if d.paid_tokens_corrected:
            fixes = "; ".join(x for x in (fixes, f"paid turns: paid_tokens {d.paid_tokens_corrected:+d}") if x)
        table.add_row(d.dataset, str(d.stored), str(d.counted), str(d.newly_counted), fixes or "none",
                      str(d.counted_not_stored), str(len(d.unreadable)))
    out.print(table)
    for d in drifts:
        if d.set_aside:
            out.print(f"{d.dataset}: {len(d.set_aside)} record files could not be read and were set aside "
                      f"(first: {escape(d.set_aside[0])}); `draftfleet enqueue` generates them again", highlight=False)
    return 0


def register(sub) -> None:
    sp = sub.add_parser("inventory", help="responses, tokens, budget, cost to finish and validation, from the store")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--tokenizer", help="tokenizer folder for the validation (default [fleet].tokenizer)")
    add_version(sp)
    sp.add_argument("--roundtrip-sample", type=int, default=200,
                    help="exact records checked decode->encode (at most 100k tokens of them; 0: skip)")
    sp.add_argument("--verify", action="store_true",
                    help="read every hidden-state file of the latest capture version through the seal stored with "
                    "it (its header and tensors); exit 1 if one changed since it was stored")
    sp.add_argument("--json", action="store_true", help="print the inventory as JSON")
    sp.set_defaults(func=cmd_inventory)

    sp = sub.add_parser("reconcile", help="rebuild the counters from the store, report and correct drift")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--json", action="store_true", help="print the drift as JSON")
    sp.set_defaults(func=cmd_reconcile)
