"""A training queue: configured runs that train one after another, one trainer at a time per runs folder.

The queue lives in the runs folder, not in a page or a process, so it survives a UI restart and the CLI sees
the same one:

    RUNS/.queue/queue.json         the entries in run order, their state, and `hold` (stop after this run)
    RUNS/.queue/entries/ID.toml    each entry's config, validated when it was added
    RUNS/.queue/trainer.json       the trainer process started last (by the queue, or by the UI's Start)
    RUNS/.queue/worker.log         what the worker said

One worker process (`python -m stabletune_core queue run`, which the UI and `queue add` start in the background)
takes the first waiting entry, gives it a fresh run folder, trains it in its own process, records how it ended
and takes the next; a failed or stopped run does not stop the queue. The worker holds a lock on `worker.lock` for
as long as it lives, so two UIs, a UI restart or the CLI never start a second one; and every trainer start (the
queue's and the UI's Start) checks under the queue's lock that no trainer is alive, so there is one trainer at a
time on the device. Nothing here imports torch, gradio or, at import time, pydantic.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .atomic import write_text_atomic
from .launch import LaunchError, checked_config, engine_env, spawn, write_run_config
from .runs.jsonfiles import read_json
from .runs.layout import RunPaths
from .runs.reader import FINAL_STATES, RunReader, find_runs, pid_alive

FOLDER = ".queue"
WAITING, RUNNING = "waiting", "running"
DEFAULT_OUTPUT_DIRS = ("", ".", "lora_output", "./lora_output")  # "no folder chosen": the runs folder decides
POLL_SECONDS = 2.0
HELD_NOTE = "The queue is held, so nothing starts now; Run the queue (or `queue run`) continues it."


class QueueError(RuntimeError):
    """What cannot be done with the queue, in one sentence."""


@dataclass
class Entry:
    id: int
    name: str
    state: str = WAITING
    added_at: float = field(default_factory=time.time)
    run: str | None = None  # the run folder, once started
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    error: str | None = None  # why it failed, in the engine's words


@dataclass
class Queue:
    entries: list[Entry] = field(default_factory=list)
    hold: bool = False  # the worker starts nothing more (the running entry finishes)
    next_id: int = 1

    def waiting(self) -> list[Entry]:
        return [e for e in self.entries if e.state == WAITING]

    def running(self) -> Entry | None:
        return next((e for e in self.entries if e.state == RUNNING), None)

    def get(self, entry_id: int) -> Entry:
        for entry in self.entries:
            if entry.id == entry_id:
                return entry
        raise QueueError(f"The queue has no entry #{entry_id}; `python -m stabletune_core queue list` shows them.")


# ---- the files -------------------------------------------------------------------------------------------------
def folder(runs_dir: Path | str) -> Path:
    return Path(runs_dir) / FOLDER


def entry_config(runs_dir: Path | str, entry_id: int) -> Path:
    return folder(runs_dir) / "entries" / f"{entry_id}.toml"


def read(runs_dir: Path | str) -> Queue:
    """The queue as queue.json holds it (empty when there is no file). Raises QueueError when the file is there but
    is not a queue (truncated, emptied, garbage): answering "empty" would let the next change overwrite every
    queued run, so the damaged file is kept as it is and the user is told what to do."""
    path = folder(runs_dir) / "queue.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Queue()
    except OSError as exc:
        raise QueueError(f"{path} cannot be read ({exc.strerror}); fix its permissions, then try again.") from None
    try:
        data = json.loads(raw.decode("utf-8"))
        entries = [_entry(e) for e in data["entries"]]
        next_id = int(data.get("next_id") or 0)
        hold = data.get("hold", False)
        if not isinstance(hold, bool) or len({e.id for e in entries}) != len(entries):
            raise ValueError("hold is not true/false, or two entries share an id")
    except (ValueError, TypeError, KeyError, AttributeError):
        raise QueueError(f"The queue file {path} is damaged, so nothing was changed; rename it (e.g. to "
                         "queue.json.damaged) to start an empty queue, or repair it by hand; the queued configs "
                         "stay in entries/ beside it.") from None
    return Queue(entries, hold, max(next_id, 1 + max((e.id for e in entries), default=0)))


def read_for_display(runs_dir: Path | str) -> tuple[Queue, str | None]:
    """(the queue, None), or (an empty queue, the sentence saying queue.json is damaged) for a page that shows the
    queue on every tick: it shows the sentence instead of an error on each refresh. Changes still go through
    changing(), which refuses a damaged file."""
    try:
        return read(runs_dir), None
    except QueueError as exc:
        return Queue(), str(exc)


def _entry(data: Any) -> Entry:
    """One entry of queue.json; ValueError/TypeError/AttributeError when it is not one (no id, a wrong type)."""
    fields = {k: v for k, v in data.items() if k in Entry.__dataclass_fields__}
    entry = Entry(**fields)
    if isinstance(entry.id, bool) or not isinstance(entry.id, int) or not isinstance(entry.name, str) \
            or entry.state not in (WAITING, RUNNING, *FINAL_STATES):
        raise ValueError(f"not an entry: {str(data)[:60]}")
    return entry


def _write(runs_dir: Path | str, queue: Queue) -> None:
    data = {"entries": [asdict(e) for e in queue.entries], "hold": queue.hold, "next_id": queue.next_id}
    write_text_atomic(folder(runs_dir) / "queue.json", json.dumps(data, indent=1))


@contextmanager
def locked(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock on `path` between processes (flock, or msvcrt on Windows); yields False when `wait` is
    off and another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        got = _lock(fd, wait)
        try:
            yield got
        finally:
            if got:
                _unlock(fd)
    finally:
        os.close(fd)


def _lock(fd: int, wait: bool) -> bool:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows hosts (A1111/Forge)
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_LOCK if wait else msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False


def _unlock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows hosts
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        return
    fcntl.flock(fd, fcntl.LOCK_UN)


@contextmanager
def changing(runs_dir: Path | str) -> Iterator[Queue]:
    """The queue, read and written back under its lock (every change goes through here)."""
    with locked(folder(runs_dir) / "lock"):
        queue = read(runs_dir)
        yield queue
        _write(runs_dir, queue)


# ---- entries ---------------------------------------------------------------------------------------------------
def add(runs_dir: Path | str, values: dict[str, Any], name: str | None = None) -> Entry:
    """Validate `values` (a config's values, e.g. the UI form's) and append them as a waiting entry.
    Raises LaunchError with one sentence per problem, before anything is queued."""
    if not values.get("output_dir"):
        values = {k: v for k, v in values.items() if k != "output_dir"}  # the runs folder decides at start
    config = checked_config(values)
    with changing(runs_dir) as queue:
        entry = Entry(queue.next_id, name or _name(values, queue.next_id))
        queue.next_id += 1
        config.save_toml(entry_config(runs_dir, entry.id))
        queue.entries.append(entry)
    return entry


def _name(values: dict[str, Any], entry_id: int) -> str:
    wanted = str(values.get("output_dir") or "")
    return Path(wanted).name if wanted not in DEFAULT_OUTPUT_DIRS else f"{values.get('output_name') or 'lora'}-{entry_id}"


def remove(runs_dir: Path | str, entry_id: int) -> Entry:
    """Take a waiting entry out of the queue (a running one is stopped from the Train tab, not here)."""
    with changing(runs_dir) as queue:
        entry = queue.get(entry_id)
        if entry.state != WAITING:
            raise QueueError(f"Entry #{entry_id} ({entry.name}) is {entry.state}, not waiting; only waiting entries "
                             "can be removed (stop a running one in the Train tab).")
        queue.entries.remove(entry)
    entry_config(runs_dir, entry_id).unlink(missing_ok=True)
    return entry


def move(runs_dir: Path | str, entry_id: int, position: int) -> list[Entry]:
    """Put a waiting entry at `position` (1 = next to run) among the waiting entries; returns them in order."""
    with changing(runs_dir) as queue:
        entry = queue.get(entry_id)
        if entry.state != WAITING:
            raise QueueError(f"Entry #{entry_id} ({entry.name}) is {entry.state}; only waiting entries can move.")
        waiting = [e for e in queue.waiting() if e is not entry]
        waiting.insert(max(0, min(position - 1, len(waiting))), entry)
        slots = iter(waiting)
        queue.entries = [next(slots) if e.state == WAITING else e for e in queue.entries]
        return queue.waiting()


def set_hold(runs_dir: Path | str, hold: bool) -> None:
    with changing(runs_dir) as queue:
        queue.hold = hold


# ---- one trainer at a time ---------------------------------------------------------------------------------
def busy_trainer(runs_dir: Path | str) -> Path | None:
    """The run a trainer is training now in this runs folder (a live run, or the trainer started last whose
    process lives and has not written its status yet), else None."""
    live = next((r.path for r in find_runs(runs_dir) if r.alive), None)
    if live:
        return live
    last = read_json(folder(runs_dir) / "trainer.json") or {}
    if last.get("pid") and pid_alive(int(last["pid"])) and last.get("run"):
        status = read_json(RunPaths(Path(last["run"])).status) or {}
        if status.get("state") not in FINAL_STATES:
            return Path(last["run"])
    return None


def start_trainer(runs_dir: Path | str, run_dir: Path, engine_python: str = sys.executable,
                  num_processes: int = 1) -> subprocess.Popen:
    """Spawn the trainer of `run_dir` (its config.toml written) unless a trainer is alive: the UI's Start and
    Resume go through here, under the queue's lock, as the queue's worker does. Raises QueueError naming the run
    that trains."""
    with locked(folder(runs_dir) / "lock"):
        refuse_if_busy(runs_dir, run_dir)
        return _spawn_recorded(runs_dir, run_dir, engine_python, num_processes)


def refuse_if_busy(runs_dir: Path | str, run_dir: Path | str) -> None:
    """QueueError naming the run that trains now, unless no trainer is alive (or it is `run_dir`'s own)."""
    busy = busy_trainer(runs_dir)
    if busy is not None and Path(busy).resolve() != Path(run_dir).expanduser().resolve():
        raise QueueError(f"{Path(busy).name} is still training; one run at a time on this machine (stop it first, "
                         "or add this one to the queue).")


def _spawn_recorded(runs_dir: Path | str, run_dir: Path, engine_python: str, num_processes: int) -> subprocess.Popen:
    """spawn(), and trainer.json says so: until the engine writes its status, only that file shows it is busy."""
    process = spawn(run_dir, engine_python, num_processes)
    write_text_atomic(folder(runs_dir) / "trainer.json",
                      json.dumps({"pid": process.pid, "run": str(run_dir), "started_at": time.time()}))
    return process


def new_run_dir(values: dict[str, Any], runs_dir: Path | str) -> Path:
    """Where a new run goes: the chosen folder, or (none chosen) RUNS/<output_name>-<time>; made free with -2,
    -3 ... so an earlier run is never reused (Resume continues one)."""
    wanted = str(values.get("output_dir") or "")
    if wanted in DEFAULT_OUTPUT_DIRS:
        path = Path(runs_dir) / f"{values.get('output_name') or 'lora'}-{time.strftime('%Y%m%d-%H%M%S')}"
    else:
        path = Path(wanted).expanduser()
    return free_run_dir(path.resolve())


def free_run_dir(path: Path) -> Path:
    """`path`, or path-2, path-3 ...: the first that holds no run."""
    def taken(p: Path) -> bool:
        return RunPaths(p).config.exists() or RunPaths(p).status.exists()

    if not taken(path):
        return path
    n = 2
    while taken(Path(f"{path}-{n}")):
        n += 1
    return Path(f"{path}-{n}")


# ---- the worker ----------------------------------------------------------------------------------------------
def worker_alive(runs_dir: Path | str) -> bool:
    with locked(folder(runs_dir) / "worker.lock", wait=False) as free:
        return not free


def start_worker(runs_dir: Path | str, engine_python: str = sys.executable, num_processes: int = 1) -> str:
    """Run the queue in a background process of `engine_python` unless one runs already or the queue is held (a
    held queue starts only when the user says so: **Run the queue**, `queue run`); says which."""
    if worker_alive(runs_dir):
        return "The queue is running."
    if read(runs_dir).hold:
        return HELD_NOTE
    log = folder(runs_dir) / "worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [engine_python, "-m", "stabletune_core", "queue", "run", "--keep-hold", "--runs-dir", str(runs_dir),
            "--num-processes", str(num_processes)]
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   env=engine_env(), start_new_session=True)
    return f"The queue runs (worker pid {process.pid})."


def run_worker(runs_dir: Path | str, engine_python: str = sys.executable, num_processes: int = 1,
               poll: float = POLL_SECONDS, say: Any = print) -> int:
    """Train the waiting entries one after another until none is left (or the queue is held)."""
    runs_dir = Path(runs_dir).resolve()
    with locked(folder(runs_dir) / "worker.lock", wait=False) as mine:
        if not mine:
            say("The queue is already running in another process.")
            return 0
        while True:
            _settle_orphans(runs_dir)
            started = _start_next(runs_dir, engine_python, num_processes, say)
            if started is None:
                say("queue: nothing left to start.")
                return 0
            if started == "busy":
                time.sleep(poll)  # another trainer (the UI's Start, an orphan of a dead worker) trains: wait
                continue
            entry_id, process = started
            exit_code = _wait_or_stop(runs_dir, entry_id, process, say)
            _finish(runs_dir, entry_id, exit_code)
            if exit_code is None:
                return 130


def _wait_or_stop(runs_dir: Path, entry_id: int, process: subprocess.Popen, say: Any) -> int | None:
    """The trainer's exit code; None when the worker was interrupted (Ctrl-C, SIGTERM). The trainer lives in a
    session of its own, so an interrupt of the worker never reaches it: it is asked to stop as the UI's Stop asks
    (it saves a checkpoint), the worker waits for it to end and holds the queue, so nothing starts behind the
    user's back. A second interrupt passes on to the trainer as its own (its second one quits at once)."""
    import signal
    import threading

    in_main = threading.current_thread() is threading.main_thread()  # only there can a handler be installed
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main else None
    try:
        try:
            return process.wait()
        except KeyboardInterrupt:
            pass
        set_hold(runs_dir, True)
        with changing(runs_dir) as queue:
            run = queue.get(entry_id).run
        RunReader(Path(run or "")).send("stop")
        say(f"queue: interrupted; asked #{entry_id} to stop (it saves a checkpoint first, resume it in the Train "
            "tab) and held the queue (`queue run` continues it).")
        while True:
            try:
                process.wait()
                return None
            except KeyboardInterrupt:
                say(f"queue: passing the interrupt on to #{entry_id}'s trainer (a second one quits it at once).")
                _signal_group(process.pid, signal.SIGINT)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _signal_group(pid: int, signum: int) -> None:
    """`signum` to the trainer's process group (an accelerate launcher and its ranks alike)."""
    try:
        os.killpg(pid, signum)
    except (OSError, AttributeError):  # gone already; or Windows, which has no process groups
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def _settle_orphans(runs_dir: Path) -> None:
    """Entries left `running` by a worker that died (a reboot, a kill): recorded once their trainer is gone."""
    with changing(runs_dir) as queue:
        for entry in queue.entries:
            if entry.state == RUNNING:
                status = read_json(RunPaths(Path(entry.run or "")).status) or {}
                if not (pid_alive(status.get("pid")) and status.get("state") not in FINAL_STATES):
                    _record_end(entry, status, None)


def _start_next(runs_dir: Path, engine_python: str, num_processes: int, say: Any):
    """(entry id, trainer process) of the entry started now, "busy" while another trainer trains, None when
    there is nothing to start. An entry that cannot start (its dataset went away) fails; the next one is taken."""
    with changing(runs_dir) as queue:
        if queue.running() is not None or busy_trainer(runs_dir) is not None:
            return "busy"
        for entry in queue.waiting():
            if queue.hold:
                return None
            try:
                from .config import read_toml

                values = read_toml(entry_config(runs_dir, entry.id))
                run_dir = new_run_dir(values, runs_dir)
                values["output_dir"] = str(run_dir)
                write_run_config(values, engine_python)
                process = _spawn_recorded(runs_dir, run_dir, engine_python, num_processes)
            except Exception as exc:  # the dataset went away, the disk is full ...: it fails, the queue goes on
                entry.state, entry.ended_at = "failed", time.time()
                entry.error = " ".join(getattr(exc, "problems", None) or [str(exc)])
                say(f"queue: #{entry.id} {entry.name} could not start: {entry.error}")
                continue
            entry.state, entry.run, entry.started_at = RUNNING, str(run_dir), time.time()
            say(f"queue: #{entry.id} {entry.name} trains in {run_dir} (pid {process.pid}).")
            return entry.id, process
        return None


def _finish(runs_dir: Path, entry_id: int, exit_code: int) -> None:
    with changing(runs_dir) as queue:
        entry = queue.get(entry_id)
        _record_end(entry, read_json(RunPaths(Path(entry.run or "")).status) or {}, exit_code)


def _record_end(entry: Entry, status: dict[str, Any], exit_code: int | None) -> None:
    """How a run ended, as its status.json says (finished / stopped / failed with the engine's sentence)."""
    state = status.get("state")
    if state not in FINAL_STATES:
        state = "failed"
        entry.error = status.get("error") or ("the trainer ended without saying why; see its train.log"
                                              if exit_code is not None else
                                              "the queue worker ended while this run trained; resume it in the "
                                              "Train tab")
    else:
        entry.error = status.get("error") if state == "failed" else None
    entry.state, entry.exit_code, entry.ended_at = state, exit_code, time.time()


# ---- the CLI: python -m stabletune_core queue add|list|remove|move|hold|run -----------------------------------
def add_parser(commands: Any) -> None:
    from .config import add_config_arguments

    queue = commands.add_parser("queue", help="A queue of runs that train one after another (also the UI's).")
    queue.set_defaults(run_tool=run_cli)
    actions = queue.add_subparsers(dest="queue_command", required=True)
    add_cmd = actions.add_parser("add", help="Queue a run: the train flags (or --config X.toml); starts the queue "
                                 "in the background unless --no-start.")
    add_config_arguments(add_cmd)
    add_cmd.add_argument("--name", default=None, help="How the entry is listed (default: its run folder's name).")
    add_cmd.add_argument("--start", action=argparse.BooleanOptionalAction, default=True,
                         help="Start the queue worker if none runs (default: yes).")
    add_cmd.add_argument("--values-json", action="store_true", help=argparse.SUPPRESS)  # the UI: values on stdin
    for name, helptext in (("list", "Show the queue."), ("run", "Run the queue in this process (the worker)."),
                           ("hold", "Start nothing more after the running entry."),
                           ("remove", "Remove a waiting entry."), ("move", "Move a waiting entry.")):
        action = actions.add_parser(name, help=helptext)
        if name in ("remove", "move"):
            action.add_argument("id", type=int, help="The entry's number (queue list).")
        if name == "move":
            action.add_argument("--to", type=int, required=True, help="Its new place among the waiting (1 = next).")
        if name == "run":  # how start_worker starts it: a held queue stays held
            action.add_argument("--keep-hold", action="store_true", help=argparse.SUPPRESS)
    for action in actions.choices.values():
        action.add_argument("--runs-dir", default="runs", help="The runs folder the queue lives in (default ./runs).")
        # dest: the launcher's process count, not a rank's (tests/test_architecture.py reserves num_processes)
        action.add_argument("--num-processes", dest="processes", type=int, default=1,
                            help=argparse.SUPPRESS if action is not actions.choices.get("run") else
                            "Devices each run trains on (accelerate).")


def run_cli(args: argparse.Namespace) -> int:
    """The queue commands; a problem is one `error:` line and exit code 2."""
    runs_dir = Path(args.runs_dir).expanduser().resolve()
    try:
        if args.queue_command == "add":
            values = json.load(sys.stdin) if args.values_json else _flag_values(args)
            entry = add(runs_dir, values, args.name)
            print(f"Queued #{entry.id} {entry.name}.")
            if args.start:
                print(start_worker(runs_dir, sys.executable, args.processes))
            return 0
        if args.queue_command == "remove":
            entry = remove(runs_dir, args.id)
            print(f"Removed #{entry.id} {entry.name} from the queue.")
            return 0
        if args.queue_command == "move":
            order = move(runs_dir, args.id, args.to)
            print("Waiting, in order: " + ", ".join(f"#{e.id} {e.name}" for e in order) + ".")
            return 0
        if args.queue_command == "hold":
            set_hold(runs_dir, True)
            print("The queue starts nothing more after the running entry (`queue run` continues it).")
            return 0
        if args.queue_command == "run":
            if not args.keep_hold:  # the user's own `queue run` continues a held queue; a background start does not
                set_hold(runs_dir, False)
            return run_worker(runs_dir, sys.executable, args.processes)
        print(describe(read(runs_dir), worker_alive(runs_dir)))
        return 0
    except (LaunchError, QueueError) as exc:
        for problem in getattr(exc, "problems", None) or [str(exc)]:
            print(f"error: {problem}", file=sys.stderr)
        return 2


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The values `queue add` was given: its --config file, then the flags typed (as `train` reads them)."""
    from .config import TrainConfig, read_toml

    values = vars(args)
    base = read_toml(values["config"]) if values.get("config") else {}
    return {**base, **{k: v for k, v in values.items() if k in TrainConfig.model_fields}}


def describe(queue: Queue, running: bool) -> str:
    """The queue as lines of text (`queue list`)."""
    lines = []
    for e in queue.entries:
        line = f"#{e.id:<3} {e.state:<9} {e.name}"
        line += f"  ({e.run})" if e.run else ""
        line += f"  {e.error}" if e.error else ""
        lines.append(line)
    worker = "running" if running else ("held" if queue.hold else "not running")
    return "\n".join(lines or ["The queue is empty."]) + f"\nworker: {worker}; {len(queue.waiting())} waiting."
