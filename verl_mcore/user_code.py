"""Load a class or function from a user's Python file (data.custom_cls, reward.custom_fn,
custom reward.sources).

A user's file runs arbitrary code when it is imported, and the trainer imports it on every rank.
A module-level statement that blocks (a sleep, a network call, a lock, `input()`) would hang
every rank forever, and one that calls `os._exit` or crashes the interpreter would end them with
no word. So every such file is first imported in a fresh interpreter under a time limit
(`check_import`, data.import_timeout_s / reward.import_timeout_s), and only then where it runs:
in the trainer (`load_user_object`: a dataset class, reward.num_workers=0) or in the scoring
workers (reward/pool.py).

Why a probe process and not an import in a thread with a timeout: a thread cannot be stopped, so
a timed-out import would keep running inside the trainer, and while it holds the GIL (a regex
that backtracks forever is one C call) the timeout could not even fire. A probe process can be
killed, leaves nothing behind in the trainer, turns an `os._exit` or a segfault into an exit
code, and prints where it was stuck (faulthandler). It costs a second import of the file, once
at start-up.

What the user's code does after the import (trainer.val_metric_fn's calls, a dataset class
reading its files) works on the trainer's own objects, so it runs in the trainer, in a thread
under a time limit (`call_with_time_limit`): one that blocks fails naming itself, where it was
stuck and the key to raise, instead of every rank waiting forever. The thread is left behind
(Python cannot stop it) and the run stops.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.util
import inspect
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any, Callable, Optional, TypeVar

from verl_mcore.utils.doing import doing

T = TypeVar("T")

# Seconds the probe may take beyond the limit (interpreter start-up, the faulthandler report)
# before it is killed from outside.
_KILL_MARGIN_S = 10.0
_REPORT = "verl_mcore_import_error"  # the key of the probe's report of an exception, on stdout
_RESULT = "verl_mcore_check_result"  # the key of its report of what `check` returned

# faulthandler: a crash prints the Python stack, and at the time limit the stack is printed
# (from a C thread, so even an import stuck holding the GIL reports) and the probe exits. The
# probe ends with os._exit: a thread the file started must not keep it alive.
_PROBE = """
import base64, faulthandler, json, os, pickle, sys, traceback
args = json.loads(sys.argv[1])
sys.path[:] = args["sys_path"]
faulthandler.enable()
faulthandler.dump_traceback_later(args["timeout_s"], exit=True)
from verl_mcore.user_code import load_user_object
try:
    obj = load_user_object(args["path"], args["name"], args["key"], args["name_field"])
    if args["check"]:
        check, check_args = pickle.loads(base64.b64decode(args["check"]))
        result = check(obj, *check_args, construct=True)
        print(json.dumps({"%s": result}), file=sys.__stdout__, flush=True)
except BaseException as e:
    # The user's frames only: from the first one in their file down to where it failed.
    frames = traceback.extract_tb((e.__cause__ or e).__traceback__)
    mine = [i for i, f in enumerate(frames) if f.filename == args["path"]]
    where = "".join(traceback.format_list(frames[mine[0]:])) if mine else ""
    print(json.dumps({"%s": str(e), "where": where}), flush=True)
    os._exit(1)
os._exit(0)
""" % (_RESULT, _REPORT)


def load_user_object(path: Optional[str], name: Optional[str], key: str,
                     name_field: str = "name") -> Any:
    """`name` from the Python file at `path`; `key` (and `name_field`) name the config keys in
    errors.

    The module is registered in sys.modules under a name derived from the absolute path, so
    loading the same file twice gives the same objects (and the same class identity).
    """
    path = _check_path(path, name, key, name_field)
    module_name = _module_name(path)
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            with doing(f"importing {key}.path={path}"):
                spec.loader.exec_module(module)
        except BaseException as e:
            del sys.modules[module_name]
            raise ValueError(f"{key}.path={path!r}: importing the file failed: "
                             f"{type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ValueError(f"{key}.{name_field}={name!r}: {path} defines no such name (it defines {public})")
    return getattr(module, name)


def _module_name(path: str) -> str:
    return "verl_mcore_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]


def _check_path(path: Optional[str], name: Optional[str], key: str, name_field: str) -> str:
    if not path or not name:
        raise ValueError(f"{key}: give both {key}.path (a Python file) and {key}.{name_field} "
                         f"(got path={path!r}, name={name!r})")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ValueError(f"{key}.path={path!r}: no such file")
    return path


def child_env() -> dict[str, str]:
    """The environment of a child interpreter that must import verl_mcore as this one does."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))


class ExitCalled(Exception):
    """User code running in the trainer's own process called os._exit
    (exit_raises_in_this_thread)."""


@contextlib.contextmanager
def exit_raises_in_this_thread(rule: tuple[str, str]):
    """User code run in the trainer's process (a scorer with reward.num_workers=0, a dataset
    class's import) would end the trainer with no word if it called `os._exit` (no exception,
    no atexit, no log). While the block runs, `os._exit` called from this thread of this process
    raises ExitCalled instead, saying "<who> called os._exit(<code>); <why>" (`rule`: who, why).
    Other threads (the watchdog's deliberate exit) and forked children (a sandbox's) still get
    the real one. A segfault cannot be caught here."""
    who, why = rule
    real, pid, thread = os._exit, os.getpid(), threading.get_ident()

    def guarded(code: int) -> None:
        if os.getpid() == pid and threading.get_ident() == thread:
            raise ExitCalled(f"{who} called os._exit({code}); {why}")
        real(code)

    os._exit = guarded
    try:
        yield
    finally:
        os._exit = real


class UserCodeError(ValueError):
    """A user's file cannot be imported: it fails, blocks, exits or crashes while importing."""


_BLOCKING_HINT = ("A module-level statement blocks (a sleep, a network call, a lock, input()): "
                  "move it into the function, or raise {} if the import is only slow.")


def check_import(path: Optional[str], name: Optional[str], key: str, timeout_s: float,
                 timeout_key: str, name_field: str = "name",
                 check: Optional[tuple[Callable, tuple]] = None) -> Any:
    """Import `path` and look up `name` in a fresh interpreter within `timeout_s` seconds (the
    config key `timeout_key`); raise UserCodeError naming the file, the key and what to do when
    that import fails, blocks, exits or crashes. The probe's stdin is empty, so an `input()` at
    module level fails instead of waiting.

    `check` = (fn, args): a module-level function (pickled by name) that the probe calls on the
    object found, `fn(obj, *args, construct=True)`, within the same time limit, e.g. to check a
    class's signatures and construct it once; what it raises fails like the import, and its
    JSON-serialisable return value is returned. When this process has imported the file already
    the probe is skipped and `fn(obj, *args, construct=False)` runs here: what it would construct
    here is constructed by whoever uses the object."""
    path = _check_path(path, name, key, name_field)
    if _module_name(path) in sys.modules:  # this process has imported it already
        if check is None:
            return None
        fn, fn_args = check
        return fn(load_user_object(path, name, key, name_field), *fn_args, construct=False)
    args = json.dumps({"sys_path": sys.path, "timeout_s": timeout_s, "path": path, "name": name,
                       "key": key, "name_field": name_field,
                       "check": base64.b64encode(pickle.dumps(check)).decode() if check else None})
    where, late = f"{key}.path={path}", f"importing the file did not finish within {timeout_key}={timeout_s} s"
    try:
        with doing(f"importing {key}.path={path} in a probe process" +
                   (f" and checking {name!r}" if check else ""), timeout_s, timeout_key):
            run = subprocess.run([sys.executable, "-c", _PROBE, args], env=child_env(),
                                 stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=timeout_s + _KILL_MARGIN_S)
    except subprocess.TimeoutExpired:  # not even faulthandler could report: killed from outside
        raise UserCodeError(f"{where}: {late} (the probe process was killed). "
                            + _BLOCKING_HINT.format(timeout_key)) from None
    if run.returncode == 0:
        if check is None:
            return None
        result = _report(run.stdout, _RESULT)
        if result is None:
            raise UserCodeError(_after_output(run.stdout + run.stderr, where, "the import probe "
                                             f"ended without reporting its check of {name!r}"))
        return result[_RESULT]
    report = _report(run.stdout, _REPORT)
    # Each message ends with the error, the last line a user sees; what led to it comes first.
    if report is not None:
        if not report["where"]:
            raise UserCodeError(report[_REPORT])
        raise UserCodeError(f"{where}: it failed here (most recent call last):\n"
                            f"{report['where'].rstrip()}\n{report[_REPORT]}")
    if "Timeout (" in run.stderr:  # faulthandler's report of where the import was stuck
        raise UserCodeError(f"{where}: {late}; it was here (most recent call first):\n"
                            f"{_user_frames(run.stderr, path)}\n{where}: {late}. "
                            + _BLOCKING_HINT.format(timeout_key))
    raise UserCodeError(_after_output(
        run.stdout + run.stderr, where, f"{exit_description(run.returncode)} while importing the "
                                        "file (a module-level os._exit, or a crash in native code)"))


def call_with_time_limit(fn: Callable[[], T], timeout_s: float, late: Callable[[str], str],
                         thread_name: str) -> T:
    """fn() in a daemon thread named `thread_name`, waited for at most `timeout_s` seconds; what
    it raises is raised here. Past the limit raise TimeoutError(late(where)), `where` being the
    thread's stack from `fn` down, most recent call last (the line it is stuck on). The thread
    is left running: the caller stops the run."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    with doing(f"waiting for {thread_name}", timeout_s):
        thread.join(timeout_s)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident)
        frames = traceback.extract_stack(frame) if frame is not None else []
        ours = [i for i, f in enumerate(frames) if f.filename == __file__ and f.name == "run"]
        frames = frames[ours[-1] + 1:] if ours else frames
        raise TimeoutError(late("".join(traceback.format_list(frames[-12:])).rstrip()))
    if "error" in result:
        raise result["error"]
    return result["value"]


def _report(stdout: str, kind: str) -> Optional[dict]:
    """The probe's last line, when it is its report of `kind` (the user's file may print too)."""
    lines = stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return report if isinstance(report, dict) and kind in report else None


def _user_frames(faulthandler_report: str, path: str) -> str:
    """The frames of a faulthandler stack from the innermost down to the last one in `path`
    (the probe's own frames below it say nothing to the user)."""
    frames = [line for line in faulthandler_report.splitlines() if line.strip().startswith("File ")]
    mine = [i for i, line in enumerate(frames) if f'"{path}"' in line]
    return "\n".join(frames[:mine[-1] + 1] if mine else frames)


def exit_description(returncode: int) -> str:
    """'the process exited with code 3' / 'the process was killed by signal 11 (SIGSEGV)'."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = "unknown"
        return f"the process was killed by signal {-returncode} ({sig})"
    return f"the process exited with code {returncode}"


def _after_output(output: str, where: str, error: str, lines: int = 15) -> str:
    """'{where}: {error}', after the last `lines` lines of what the child process printed, if it
    printed anything: the error is the message's last line, the last one a user sees (a tail
    printed after it, or an "(nothing)" there, hid it)."""
    output = output.strip()
    if not output:
        return f"{where}: {error}"
    tail = "\n".join(output.splitlines()[-lines:])
    return f"{where}: the process printed (its last lines):\n{tail}\n{where}: {error}"


# ------------------------------------------------------------------ a user's function in the trainer

class _Argument:
    """What the start-up check binds a user function's positional parameters to (no engine,
    batch or group exists yet)."""


def check_user_function(obj: Any, key: str, path: str, name: str, kwargs: dict,
                        params: tuple[str, ...], signature_text: str,
                        construct: bool = False) -> str:
    """That `obj` (the config key `key`'s) can be called as name(*params, **kwargs): in the
    import probe (check_import, which passes `construct`; a function constructs nothing).
    Raises ValueError naming the file, the function and `signature_text`, the signature
    expected."""
    what = f"{key}.name={name!r} in {path}"
    if inspect.isclass(obj) or not callable(obj):
        kind = "a class" if inspect.isclass(obj) else f"an object of type {type(obj).__name__}"
        raise ValueError(f"{what} is {kind}, not a function: {key} is {signature_text}")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without signature data: the first call will tell
        return "function"
    try:
        signature.bind(*(_Argument() for _ in params), **kwargs)
    except TypeError as e:
        call = ", ".join(list(params) + [f"{k}=..." for k in kwargs])
        raise ValueError(f"{what}: {name}{signature} cannot be called as {name}({call}) "
                         f"({key}.kwargs go to each call; {key} is {signature_text}): "
                         f"{e}") from None
    return "function"


def load_user_function(cfg, key: str, params: tuple[str, ...],
                       signature_text: str) -> Optional[tuple[Callable, str]]:
    """(the function, its file's absolute path) of a UserFunctionConfig at `key`, or None when
    none is configured (`load_checked`, its signature checked by check_user_function)."""
    return load_checked(cfg, key, (check_user_function, (key, cfg.path, cfg.name, dict(cfg.kwargs),
                                                         params, signature_text)))


def load_checked(cfg, key: str, check: tuple[Callable, tuple]) -> Optional[tuple[Any, str]]:
    """(the object, its file's absolute path) a config section at `key` (path, name, kwargs,
    import_timeout_s) names, or None when none is configured. The file is imported first in a
    fresh interpreter under cfg.import_timeout_s, where `check` runs on the object
    (check_import), so a file that blocks, exits or fails, a missing name or a failed check stop
    here, before any model is built, naming the file and the name."""
    if not (cfg.path or cfg.name or cfg.kwargs):
        return None
    check_import(cfg.path, cfg.name, key, cfg.import_timeout_s, f"{key}.import_timeout_s", check=check)
    rule = (f"{key} ({cfg.path}, importing it in the trainer)",
            "the trainer would have ended without a word: its file must not exit at import")
    try:
        with exit_raises_in_this_thread(rule):
            obj = load_user_object(cfg.path, cfg.name, key)
    except ExitCalled as e:
        raise ValueError(str(e)) from None
    return obj, os.path.abspath(os.path.expanduser(cfg.path))


class UserFunction:
    """A user's function (the config key `key`'s, `name` in the file `path`), called in the
    trainer with its kwargs: what it raises, and an exit it attempts, stop the run naming the
    key, the file, the function and the line."""

    def __init__(self, key: str, fn: Callable, kwargs, path: str, name: str):
        self.fn, self.kwargs, self.path, self.name = fn, dict(kwargs), path, name
        self.label = f"{key} {path}:{name}"

    def call(self, *args, doing_what: str, returns: str, error: type, where: str = "") -> Any:
        """fn(*args, **kwargs) under a `doing` note ("calling <label> <doing_what>"); `returns`
        says what it should do instead of exiting, `error` is raised for what it raises, with
        `where` appended."""
        rule = (self.label, f"it runs in the trainer, which this would have ended: {returns}")
        try:
            with doing(f"calling {self.label} {doing_what}"), exit_raises_in_this_thread(rule):
                return self.fn(*args, **self.kwargs)
        except (Exception, SystemExit) as e:  # ExitCalled for an os._exit; sys.exit too
            raise error(f"{self.label} raised {type(e).__name__}: {e}"
                        f"{user_line(e, self.path)}{where}") from e


def user_line(error: BaseException, path: str) -> str:
    """' (at <path>, line N, in fn)' for the deepest frame of `error` in the user's file."""
    mine = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
    return f" (at {path}, line {mine[-1].lineno}, in {mine[-1].name})" if mine else ""
