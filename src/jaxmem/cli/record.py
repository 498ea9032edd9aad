"""Record a JAX program's device memory as it runs: peaks, leaks, and a post-mortem at out-of-memory.

    jaxmem record --out run1 -- python train.py --steps 100
    jaxmem record --report run1 --html run1.html

The program runs unchanged, on whatever devices it uses. The recording (a folder) holds
memory_stats() per device at each completed call of a jitted function and at an interval, device
memory profiles (pprof: `pprof -diff_base run1/profiles/0002-call.pb.gz run1/profiles/0005-call.pb.gz`),
the compiled programs' figures, and a post-mortem for each RESOURCE_EXHAUSTED the program raises.
The program's exit code is jaxmem's. From Python: `with jaxmem.record("run1"): ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxmem.cli import OneLineParser
from jaxmem.units import parse_size


def _parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").strip()
    p = OneLineParser(prog="jaxmem record", description=doc.splitlines()[0],
                      epilog="\n".join(doc.splitlines()[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="jaxmem-recording", help="folder to record into (default: jaxmem-recording)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between memory_stats() readings besides each call's")
    p.add_argument("--profile-period", type=float, default=60.0, help="seconds between periodic profiles (default 60)")
    p.add_argument("--max-profiles", type=int, default=24, help="profiles kept in the ring (default 24)")
    p.add_argument("--max-size", default="512MiB", help="the most the recording may write (default 512MiB)")
    p.add_argument("--no-count-calls", action="store_true",
                   help="do not wrap jax.jit: readings at the interval only, no per-call readings or leak steps")
    p.add_argument("--report", metavar="DIR", help="show a recording instead of making one")
    p.add_argument("--html", metavar="FILE", help="with --report: write the HTML page")
    p.add_argument("--json", action="store_true", help="with --report: print the summary as JSON")
    p.add_argument("--predict", metavar="TARGET", help="with --report: jaxmem's pool prediction for this factory's "
                   "step (FILE.py:make), set beside the device's peak after each call of the recorded step")
    p.add_argument("--device", metavar="PRESET", help="with --predict: the device preset (e.g. tpu-v5e-16gb)")
    p.add_argument("--donate", metavar="0,1", help="with --predict: the arguments the step donates")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    return p


def main(argv: list[str]) -> int:
    from jaxmem.errors import ConfigError

    args = _parser().parse_args(argv)
    if args.report:
        return report(args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ConfigError("no command to record: jaxmem record [options] -- python train.py ...")
    if args.interval <= 0 or args.profile_period <= 0 or args.max_profiles < 1:
        raise ConfigError("--interval and --profile-period must be positive, --max-profiles at least 1")
    from jaxmem.recording.launch import run_recorded

    settings = {"out": str(Path(args.out).resolve()), "interval": args.interval, "profile_period": args.profile_period,
                "max_profiles": args.max_profiles, "max_bytes": parse_size(args.max_size),
                "count_calls": not args.no_count_calls}
    code = run_recorded(command, settings)
    if Path(settings["out"], "recording.json").exists():
        from jaxmem.recording.report import load_recording, render_text

        print(render_text(load_recording(settings["out"])), file=sys.stderr)
    else:
        print(f"jaxmem record: nothing recorded: the program did not import JAX (exit {code})", file=sys.stderr)
    return code


def report(args: argparse.Namespace) -> int:
    from jaxmem.recording.report import load_recording, render_html, render_text

    from jaxmem.errors import ConfigError

    data = load_recording(args.report)
    if args.predict:
        if not args.device:
            raise ConfigError("--predict needs --device PRESET")
        from jaxmem.recording.predict import beside, pool_peaks

        data["predicted"] = {"target": args.predict, "device": args.device,
                             "peaks": pool_peaks(args.predict, args.device, args.donate)}
        data["beside"] = beside(data["summary"], data["predicted"]["peaks"])
    if args.html:
        Path(args.html).write_text(render_html(data), encoding="utf-8")
    if args.json:
        print(json.dumps({**data["summary"], "postmortems": data["postmortems"], "predicted": data.get("predicted"),
                          "beside": data.get("beside")}, indent=1, default=str))
    else:
        print(render_text(data))
    return 0
