"""How `jaxmem record -- python train.py` enters the user's process, unchanged.

The command runs as the user typed it, with one folder put first on its PYTHONPATH. That folder
holds only `sitecustomize.py` (which Python's `site` imports at start-up) and a link to the
jaxmem package, so that nothing else of jaxmem's environment, its JAX least of all, is visible
to the program. `sitecustomize.py`:

1. runs the program's own `sitecustomize` if it has one;
2. waits for the process to import JAX (an import hook) and starts the recorder then: JAX's
   backends are not started by it, so platform settings and `jax.distributed.initialize()` work
   as before;
3. at that moment removes `JAXMEM_RECORD` and the folder from the environment, so that the
   subprocesses of the process it records run as they would have. A process that never imports
   JAX (a launcher such as `jaxmem run`, or a shell script's Python) passes them on untouched,
   so the recorder starts in the first process of the command that imports JAX:

       jaxmem record -- jaxmem run --memory 20GiB -- python train.py   # records train.py
       jaxmem run --memory 20GiB -- jaxmem record -- python train.py   # the same

The recorder writes its files as it goes and its summary when the process exits (atexit).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

ENV = "JAXMEM_RECORD"

SITECUSTOMIZE = '''\
"""Started by `jaxmem record`: records this process's device memory once it imports JAX."""
import importlib.abc, importlib.machinery, importlib.util, json, os, sys

_DIR = os.path.dirname(os.path.abspath(__file__))


def _settings():
    text = os.environ.get("JAXMEM_RECORD")
    return json.loads(text) if text else None


def _leave_environment():
    """This process is the one recorded: its subprocesses get the environment without jaxmem."""
    os.environ.pop("JAXMEM_RECORD", None)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != _DIR]
    if parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        os.environ.pop("PYTHONPATH", None)


def _chain():
    """The program's own sitecustomize, found past this folder."""
    path = [p for p in sys.path if os.path.abspath(p or ".") != _DIR]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


class _AfterJax(importlib.abc.MetaPathFinder):
    def __init__(self, settings):
        self.settings = settings

    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("jax")
        if spec is None or spec.loader is None:
            return spec
        loader, settings = spec.loader, self.settings
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _leave_environment()
            from jaxmem.recording.launch import start_from_settings
            start_from_settings(settings)
        loader.exec_module = exec_module
        return spec


_settings_now = _settings()
_chain()
if _settings_now is not None:
    sys.meta_path.insert(0, _AfterJax(_settings_now))
'''


def boot_folder(parent: str | None = None) -> Path:
    """A new folder holding `sitecustomize.py` and a link to this jaxmem package."""
    folder = Path(tempfile.mkdtemp(prefix="jaxmem-record-", dir=parent))
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    package = Path(__file__).resolve().parent.parent
    (folder / "jaxmem").symlink_to(package, target_is_directory=True)
    return folder


def child_environment(folder: Path, settings: dict[str, Any], base: dict[str, str] | None = None) -> dict[str, str]:
    """The program's environment: the user's, with the boot folder first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env[ENV] = json.dumps(settings)
    return env


def start_from_settings(settings: dict[str, Any]) -> Any:
    """Start a recorder in this process from `jaxmem record`'s settings (inside the program)."""
    from jaxmem.recording.recorder import RecordOptions, Recorder

    argv = settings.pop("argv", None)
    options = RecordOptions(**settings)
    return Recorder(options, argv=argv).start()


def finish(out: str | os.PathLike, exit_code: int) -> dict[str, Any]:
    """Complete a recording after the program ended: its exit code in the summary, and a summary
    rebuilt from the files where the program could not write one (killed, interrupted hard)."""
    from jaxmem.recording.store import RecordingStore
    from jaxmem.recording.summary import summarize_files

    out = Path(out)
    try:
        summary = json.loads((out / "recording.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = summarize_files(out, {"rebuilt": True})
    summary["exit_code"] = exit_code
    RecordingStore(out).write_json("recording.json", summary)
    return summary


def run_recorded(command: list[str], settings: dict[str, Any]) -> int:
    """Run `command` with the recorder in it; returns its exit code (128 + N for signal N).
    Ctrl-C reaches the program, which stops as it would and leaves its recording."""
    import shutil
    import signal
    import subprocess

    from jaxmem.errors import ConfigError

    if not command:
        raise ConfigError("no command to record: jaxmem record [options] -- python train.py ...")
    folder = boot_folder()
    Path(settings["out"]).mkdir(parents=True, exist_ok=True)
    env = child_environment(folder, {**settings, "argv": command})
    try:
        proc = subprocess.Popen(command, env=env)
    except OSError as err:
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(f"cannot run {command[0]!r}: {err.strerror}") from None
    # Ctrl-C is the program's to handle; jaxmem waits for it to end. (Ignored only now: an
    # ignored SIGINT would be inherited by the program, and Python would not raise
    # KeyboardInterrupt in it.)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
        shutil.rmtree(folder, ignore_errors=True)
    code = 128 - code if code < 0 else code
    if (Path(settings["out"]) / "samples.jsonl").exists() or (Path(settings["out"]) / "recording.json").exists():
        finish(settings["out"], code)
    return code
