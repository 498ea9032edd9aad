"""Show or repair the node's GPU memory reservations (the ledger `jaxmem run` uses).

    jaxmem share status            # per device: total, reserved, free; who holds what; the queue
    jaxmem share status --json     # the same as JSON
    jaxmem share repair --device 0 # rebuild a corrupt ledger from its journal, keeping live holders

The ledgers live in $JAXMEM_STATE_DIR, else in the node-wide /dev/shm/jaxmem (or /tmp/jaxmem
where there is no /dev/shm), one directory for every user of the node's GPUs.
Looking is an access: reservations of processes that have exited are reclaimed first.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from jaxmem.cli import OneLineParser
from jaxmem.errors import ConfigError
from jaxmem.reports.escape import markup, plain
from jaxmem.share import store
from jaxmem.share.ledger import status
from jaxmem.share.repair import repair
from jaxmem.units import format_size, parse_size


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="jaxmem share", description=__doc__.strip().splitlines()[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="\n".join(__doc__.strip().splitlines()[2:]))
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("status", help="reservations, free and total per device")
    show.add_argument("--json", action="store_true", help="print JSON instead of tables")
    fix = sub.add_parser("repair", help="rebuild a corrupt ledger from its journal")
    fix.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    fix.add_argument("--reset", action="store_true",
                     help="if the journal cannot be used either, start an empty ledger (forgets its reservations)")
    fix.add_argument("--capacity", help="with --reset: the device's memory total, e.g. 80GiB or h100-80gb")
    return parser


def _age(since: float) -> str:
    seconds = max(0, int(time.time() - since))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def render(rows: list[dict[str, Any]]) -> None:
    """Print the status rows as rich tables, one per device."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not rows:
        console.print(f"no reservations (state directory {markup(store.state_dir())})")
        return
    for row in rows:
        if "error" in row:
            console.print(f"[bold red]device {row['device']}[/]: {markup(row['error'])}", soft_wrap=True)
            continue
        title = (f"device {row['device']}: {format_size(row['capacity'])} total, "
                 f"{format_size(row['reserved'])} reserved, {format_size(row['free'])} free")
        console.print(title, soft_wrap=True)
        if not row["reservations"] and not row["waiters"]:
            continue
        table = Table()
        for name, justify in (("id", "right"), ("pids", "left"), ("label", "left"),
                              ("bytes", "right"), ("share", "right"), ("held for", "right")):
            table.add_column(name, justify=justify)
        for r in row["reservations"]:
            table.add_row(str(r["id"]), ",".join(map(str, r["pids"])), markup(r["label"]), format_size(r["bytes"]),
                          f"{100 * r['bytes'] / row['capacity']:.1f}%", _age(r["since"]))
        for w in row["waiters"]:
            table.add_row(f"#{w['ticket']}", str(w["pid"]), f"{markup(w['label'])} (waiting)", format_size(w["bytes"]),
                          f"{100 * w['bytes'] / row['capacity']:.1f}%", _age(w["since"]), style="dim")
        console.print(table)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.action == "status":
        rows = status()
        if args.json:
            print(json.dumps({"state_dir": str(store.state_dir()), "devices": rows}, indent=2))
        else:
            render(rows)
        return 1 if any("error" in row for row in rows) else 0
    if args.capacity is not None and not args.reset:
        raise ConfigError("--capacity is only used with --reset")
    capacity = parse_size(args.capacity) if args.capacity is not None else None
    report = repair(args.device, reset=args.reset, capacity=capacity)
    if report["action"] == "ok":
        print(f"device {args.device}: ledger is sound; {len(report['kept'])} live reservation(s), "
              f"{len(report['dropped'])} of exited processes reclaimed")
    else:
        print(f"device {args.device}: ledger {report['action']}; kept {len(report['kept'])} live reservation(s) "
              f"{report['kept']}, dropped {len(report['dropped'])} of exited processes {report['dropped']}; "
              f"damaged file kept as {plain(report['moved_to'])}"
              + (f"; skipped {len(report['skipped'])} damaged journal line(s) ({plain(report['skipped'][0])}, ...) "
                 "and kept every live reservation found elsewhere" if report["skipped"] else ""))
    return 0
