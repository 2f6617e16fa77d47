"""``draftfleet import`` and ``draftfleet export``: an earlier run's records in, training files out."""

from __future__ import annotations

from rich.markup import escape

from draftfleet.cli.common import add_common, add_version, config, config_or_store, err, optional_tokenizer, out, redis_client


def cmd_import(args) -> int:
    import msgspec

    from draftfleet.ledger import Ledger
    from draftfleet.producer.enqueue import check_manifest
    from draftfleet.producer.importer import import_file
    from draftfleet.store import open_store

    cfg = config(args)
    ds = cfg.dataset(args.dataset)
    store = open_store(cfg)
    manifest = check_manifest(store, cfg, ds, new_version=False)
    try:
        ledger = Ledger(redis_client(args, cfg))
        ledger.r.ping()
    except Exception as exc:  # counting can wait: the reconciler counts what the store holds
        err.print(f"[yellow]counters not updated ({type(exc).__name__}); `draftfleet reconcile` will count them[/]")
        ledger = None
    summary = import_file(args.path, ds, manifest, store, optional_tokenizer(args, cfg), ledger, args.label,
                          finish_rule=args.finish_rule)
    if args.json:
        print(msgspec.json.encode(summary).decode())
        return 0
    out.print(f"imported {summary.imported:,} records ({summary.completion_tokens:,} completion tokens; "
              f"{summary.exact} exact, {summary.retokenized} re-tokenized) into {ds.name}; "
              f"{summary.already_present} already present; {summary.rejected} rejected", highlight=False)
    if summary.rejected_by_kind:
        out.print("rejected: " + ", ".join(f"{k} {v}" for k, v in summary.rejected_by_kind.items())
                  + f"; raw lines in {store.quarantine_location(ds.name)}", highlight=False)
    if summary.cut_last_line:
        out.print("[yellow]the last line was cut off (the writer was killed mid-line): skipped[/]")
    how = {"file": "from the file's finish_reason", "end_of_turn": "by the end-of-turn id",
           "max_tokens": f"by length against max_tokens {ds.max_tokens:,}"}
    parts = [f"{sum(v.values()):,} {how.get(k, k)} (" + ", ".join(f"{r} {n:,}" for r, n in sorted(v.items())) + ")"
             for k, v in summary.finish_decided.items()]
    if parts:
        out.print(f"finish reasons (rule {summary.finish_rule}): " + "; ".join(parts), highlight=False)
    return 0


def cmd_export(args) -> int:
    import msgspec

    from draftfleet.export import ExportError, export_dataset
    from draftfleet.store import open_store

    cfg, root = config_or_store(args)
    store = open_store(cfg or root)
    known = sorted({d.name for d in cfg.datasets} | set(store.datasets())) if cfg else store.datasets()
    names = args.dataset or known
    unknown = [n for n in names if n not in known]
    if unknown:
        err.print(f"[red]error[/]: unknown dataset(s) {', '.join(unknown)}: {root} has "
                  + (", ".join(known) or "no datasets"), highlight=False)
        return 1
    from draftfleet.export import features

    hidden_formats = [f for f in args.format if f in features.FORMATS]
    text_formats = [f for f in args.format if f not in features.FORMATS]
    tok = optional_tokenizer(args, cfg) if text_formats else None  # also tells which reasoning the template renders
    try:
        manifests = [export_dataset(store, name, args.out, text_formats, exclude_truncated=args.exclude_truncated,
                                    exclude_invalid=args.exclude_invalid, include_truncated=args.include_truncated,
                                    tokenizer=tok, version=args.version, all_versions=args.all_versions)
                     for name in names] if text_formats else []
        if hidden_formats:
            from draftfleet.hidden import CaptureError, capture_settings, open_hidden

            try:
                model_path = capture_settings(cfg)[0].path if cfg else None
            except CaptureError:
                model_path = None
            captured = names if args.dataset else [n for n in names if open_hidden(store).versions(n)]
            template = (tok or optional_tokenizer(args, cfg)) if captured else None
            with _fetch_progress(args.json or store.local) as fetching:
                found = [features.export_features(store, name, args.out, hidden_formats, model_path=model_path,
                                                  version=args.capture_version, torch_python=args.torch_python,
                                                  draft_vocab_size=args.draft_vocab_size, records_version=args.version,
                                                  all_versions=args.all_versions,
                                                  chat_template_sha256=template.chat_template_sha256 if template else None,
                                                  fetching=fetching(name))
                         for name in captured]
            for f in found:
                for why in f.bad_files:
                    err.print(f"[red]error[/]: {escape(why)}: not exported", highlight=False)
            if args.json:
                print(msgspec.json.encode(found).decode())
            else:
                for f in found:
                    out.print(f"exported {f.rows:,} captured turns ({f.tokens:,} tokens) of {f.dataset} capture "
                              f"v{f.capture_version}: " + ", ".join(f.folders.values())
                              + (f"; {f.missing:,} turns not captured yet" if f.missing else ""), highlight=False)
                    for note in f.notes:
                        out.print(f"  note: {note}", highlight=False)
    except ExportError as exc:
        err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
        return 1
    if args.json:
        if text_formats:
            print(msgspec.json.encode(manifests).decode())
        return 0
    for m in manifests:
        of = f"version {m.version}" if m.version is not None else "every version"
        out.print(f"exported {m.records:,} records of {m.dataset} ({of}) to {args.out}: "
                  + ", ".join(m.files) + f" (excluded: {m.excluded_truncated} truncated, "
                  f"{m.excluded_invalid} invalid; {m.truncated_left_out} cut turns left out of sharegpt"
                  + (f"; {m.other_versions:,} records of other versions left out" if m.other_versions else "") + ")",
                  highlight=False)
        for note in m.notes:
            out.print(f"  note: {note}", highlight=False)
    return 0


def _fetch_progress(quiet: bool):
    """A rich bar (on stderr) per dataset whose hidden states are downloaded from a bucket."""
    from contextlib import contextmanager

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    @contextmanager
    def bars():
        progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), console=err, disable=quiet)

        def fetching(name: str):
            bar = None

            def tick(done: int, total: int) -> None:
                nonlocal bar
                if bar is None:
                    bar = progress.add_task(f"download {name}'s hidden states", total=total)
                progress.update(bar, completed=done, total=total)

            return tick

        with progress:
            yield fetching

    return bars()


def register(sub) -> None:
    sp = sub.add_parser("import", help="bring an earlier run's raw_responses.jsonl into the store")
    sp.add_argument("path", help="a JSONL file: one prompt and its output (text and/or output_ids) per line")
    add_common(sp)
    sp.add_argument("--dataset", "-d", required=True, help="the dataset (of the config) the lines belong to")
    sp.add_argument("--label", default="import", help="backend for imported lines that name none (a raw export names its own)")
    sp.add_argument("--finish-rule", choices=("max-tokens", "end-of-turn"), default="max-tokens",  # importer.FINISH_RULES
                    help="for lines without finish_reason whose ids lack the end-of-turn id: max-tokens calls them "
                    "truncated only when at least max_tokens long (default); end-of-turn always calls them truncated")
    sp.add_argument("--tokenizer", help="tokenizer folder (default [fleet].tokenizer): re-tokenizes text-only lines")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_import)

    sp = sub.add_parser("export", help="write training files (SpecForge sharegpt, raw_responses, token rows)")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append",
                    help="export this dataset (repeatable; default every dataset of the config or store)")
    sp.add_argument("--format", "-f", action="append", choices=["sharegpt", "raw", "tokens", "speculators", "specforge"],
                    required=True, help="sharegpt: SpecForge conversations; raw: raw_responses with ids; tokens: "
                    "input_ids + loss_mask rows; speculators / specforge: captured hidden states in each trainer's "
                    "offline layout (repeatable)")
    add_version(sp)
    sp.add_argument("--capture-version", type=int, help="speculators/specforge: the capture version (default the latest)")
    sp.add_argument("--torch-python", help="speculators/specforge: an interpreter with torch and safetensors to "
                    "write their torch.save files (default this one, when it has torch)")
    sp.add_argument("--draft-vocab-size", type=int, default=32000,
                    help="specforge: the draft vocabulary of its vocab mapping (default 32000, at most the target's)")
    sp.add_argument("--out", required=True,
                    help="folder for <dataset>.<format>.jsonl and <dataset>.manifest.json (other datasets' files stay)")
    sp.add_argument("--exclude-truncated", action="store_true", help="leave out responses cut at max_tokens (every format)")
    sp.add_argument("--include-truncated", action="store_true",
                    help="keep answers cut at max_tokens in the sharegpt conversations (left out by default: a trainer "
                    "would close them with an end-of-turn the model never wrote); raw and tokens always keep them")
    sp.add_argument("--exclude-invalid", action="store_true",
                    help="leave out records with no ids, ids outside the vocabulary, or a stop without end-of-turn")
    sp.add_argument("--tokenizer", help="tokenizer folder (default [fleet].tokenizer); needed by -f tokens")
    sp.add_argument("--json", action="store_true", help="print the manifests as JSON")
    sp.set_defaults(func=cmd_export)
