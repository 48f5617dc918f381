"""The two trusted programs of the ``code_unit_tests`` reward, and the wire format between them.

tandem/rl/rewards/code.py copies this file into two sandboxed runs (tandem/rl/sandbox/__init__.py):

* the **solution server** (:func:`serve`) runs the policy's code and nothing else: it
  never receives the tests. It answers requests on a socket: call this function,
  read this attribute, list this iterator.
* the **test runner** (:func:`run_tests`) holds the tests. The solution's top-level
  names are proxies (:class:`Remote`) whose calls go over the socket, so a test such as
  ``assert f(x) == y`` compares a plain value sent back by the server with ``y``
  here, where the solution cannot reach: it cannot read the tests, patch ``unittest``
  or ``assert``, or return an object whose ``__eq__`` lies. The runner writes
  ``{"passed": p, "total": t}`` to a pipe only it holds.

Names: the runner reads every name the test code mentions from the compiler's symbol
tables and resolves it itself (:func:`_test_globals`): the tests' own bindings, the
entry point, the runner's builtins and stdlib modules come first, so a solution that
defines ``abs``, ``len`` or a class called ``math`` changes nothing the tests read; it
contributes only the names the tests read that nothing else provides. What the server
sends is treated as data the solution chose (it can write that message itself).

Values cross as data (:func:`encode` / :func:`decode`): None, bools, numbers, strings,
bytes and lists, tuples, sets, frozensets and dicts of them (subclasses, numpy scalars
and other ``numbers`` types as their plain base type); anything else stays in the server
and travels as a handle. So tests that inspect solution objects beyond calls,
attributes, items, iteration, ``len``, ``in``, ``bool``, ``str`` and ``repr`` fail, as
do tests that pass non-data values (a lambda) or check that a call mutated its argument.

Stdlib only, and compatible with the sandbox's interpreter (``python3`` of the host).
"""

from __future__ import annotations

import base64
import builtins
import json
import numbers
import os
import signal
import socket
import struct
import sys

MAX_FRAME = 16 << 20  # bytes in one message; a bigger one ends the connection
MAX_DEPTH = 100  # nesting of a value; deeper parts travel as handles
READY_GRACE_S = 10.0  # on top of per_test_s, for the server's interpreter to start
_NO_IMPORT = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}
_SITE_NAMES = {"exit", "quit", "help", "copyright", "credits", "license"}  # builtins site adds
# The usual names of modules outside the stdlib: tests that read them without an import mean the
# module, so the runner resolves them (the module where it can import it, else nothing: a
# NameError, as in a plain run), never the solution (a class called np with a lenient isclose).
_MODULE_ALIASES = {"np": "numpy", "pd": "pandas", "plt": "matplotlib.pyplot", "scipy": "scipy"}


class RemoteError(Exception):
    """An exception raised by the solution whose type is not a builtin exception."""


class ProtocolError(Exception):
    """The server broke the protocol or went away; every later call fails."""


class _Timeout(BaseException):
    """The per-test (runner) or per-call (server) time limit; not caught by ``except Exception``."""


def _on_alarm(signum, frame):
    raise _Timeout("time limit reached")


def _alarm(seconds: float) -> None:
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)


# ---- values -----------------------------------------------------------------------------


def encode(value, handle_of, depth: int = 0):
    """``value`` as JSON data; what is not data becomes ``["h", handle_of(value), type]``."""
    if value is None or type(value) in (bool, str):
        return value
    if depth > MAX_DEPTH:
        return ["h", handle_of(value), type(value).__name__]
    if type(value).__name__ == "bool_":  # numpy's bool is no bool subclass
        return bool(value)
    if isinstance(value, numbers.Integral):
        v = int(value)
        return v if -(1 << 53) < v < (1 << 53) else ["i", format(v, "x")]
    if isinstance(value, numbers.Real):
        return ["f", repr(float(value))]
    if isinstance(value, numbers.Complex):
        return ["c", repr(complex(value).real), repr(complex(value).imag)]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return ["b", base64.b64encode(bytes(value)).decode("ascii")]
    for kind, tag in ((list, "l"), (tuple, "t"), (frozenset, "F"), (set, "s")):
        if isinstance(value, kind):
            return [tag, [encode(v, handle_of, depth + 1) for v in value]]
    if isinstance(value, dict):
        return [
            "d",
            [
                [encode(k, handle_of, depth + 1), encode(v, handle_of, depth + 1)]
                for k, v in value.items()
            ],
        ]
    return ["h", handle_of(value), type(value).__name__]


def decode(data, from_handle):
    """The value :func:`encode` made; handles become ``from_handle(id, type name)``."""
    if data is None or isinstance(data, (bool, int, str)):
        return data
    if not isinstance(data, list) or not data:
        raise ProtocolError(f"not a value: {type(data).__name__}")
    tag, *rest = data
    if tag == "i":
        return int(rest[0], 16)
    if tag == "f":
        return float(rest[0])
    if tag == "c":
        return complex(float(rest[0]), float(rest[1]))
    if tag == "b":
        return base64.b64decode(rest[0], validate=True)
    if tag == "h":
        return from_handle(int(rest[0]), str(rest[1]))
    if tag == "d":
        return {decode(k, from_handle): decode(v, from_handle) for k, v in rest[0]}
    kinds = {"l": list, "t": tuple, "s": set, "F": frozenset}
    if tag in kinds:
        return kinds[tag](decode(v, from_handle) for v in rest[0])
    raise ProtocolError(f"unknown tag {tag!r}")


# ---- frames -----------------------------------------------------------------------------


class Channel:
    """Length-prefixed JSON messages over a stream socket."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.broken: str | None = None

    def send(self, msg) -> None:
        data = json.dumps(msg).encode()
        if len(data) > MAX_FRAME:
            raise ProtocolError(f"message of {len(data)} bytes is over {MAX_FRAME}")
        self.sock.sendall(struct.pack(">I", len(data)) + data)

    def recv(self):
        """The next message. A time limit that interrupts it before its first byte leaves
        the stream in step; one in the middle of a message breaks the channel."""
        if self.broken is not None:
            raise ProtocolError(self.broken)
        size = struct.unpack(">I", self._exactly(4))[0]
        if size > MAX_FRAME:
            self.broken = f"message of {size} bytes is over {MAX_FRAME}"
            raise ProtocolError(self.broken)
        try:
            return json.loads(self._exactly(size, started=True))
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"unreadable message: {type(exc).__name__}") from None

    def _exactly(self, n: int, started: bool = False) -> bytes:
        buf = bytearray()
        try:
            while len(buf) < n:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
                if not chunk:
                    self.broken = "the solution process ended"
                    raise ProtocolError(self.broken)
                buf += chunk
        except BaseException:
            if started or buf:
                self.broken = self.broken or "interrupted in the middle of a message"
            raise
        return bytes(buf)


# ---- the solution server ------------------------------------------------------------------


def serve(sock_fd: int, solution_file: str, per_call_s: float) -> None:
    """Run the solution, report its top-level names, then answer requests until EOF."""
    chan = Channel(sock_fd)
    objects: dict[int, object] = {}
    ids: dict[int, int] = {}

    def handle_of(obj) -> int:
        key = id(obj)
        if key not in ids:
            ids[key] = len(objects)
            objects[ids[key]] = obj
        return ids[key]

    ns = {"__name__": "solution", "__builtins__": __builtins__}
    error = None
    try:
        with open(solution_file, encoding="utf-8") as f:
            source = f.read()
        _alarm(per_call_s)
        exec(compile(source, solution_file, "exec"), ns)
    except BaseException as exc:  # syntax errors, sys.exit, timeouts: keep what was defined
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    names = {}
    for name, value in list(ns.items())[:2000]:
        if name.startswith("__"):
            continue
        if type(value) is type(sys):
            names[name] = ["m", value.__name__]
        else:
            names[name] = encode(value, handle_of)
    chan.send({"ready": names, "error": error})
    while True:
        try:
            req = chan.recv()
        except ProtocolError:
            return
        reply = _answer(req, objects, handle_of, per_call_s)
        try:
            chan.send(reply)
        except ProtocolError as exc:  # a result too big to send
            chan.send({"seq": reply.get("seq"), "exc": ["MemoryError", str(exc)]})


def _answer(req, objects, handle_of, per_call_s: float):
    seq = req.get("seq")

    def value(data):
        return decode(data, lambda h, _t: objects[h])

    try:
        _alarm(per_call_s)
        target = objects[req["h"]]
        op = req["op"]
        args = [value(a) for a in req.get("args", [])]
        if op == "call":
            kwargs = {k: value(v) for k, v in req.get("kwargs", {}).items()}
            result = target(*args, **kwargs)
        elif op == "getattr":
            result = getattr(target, args[0])
        elif op == "setattr":
            result = setattr(target, args[0], args[1])
        elif op == "getitem":
            result = target[args[0]]
        elif op == "setitem":
            target[args[0]] = args[1]
            result = None
        elif op == "list":
            result = list(target)
        elif op == "next":
            result = next(target)
        elif op in ("len", "bool", "str", "repr"):
            result = {"len": len, "bool": bool, "str": str, "repr": repr}[op](target)
        elif op == "contains":
            result = args[0] in target
        else:
            raise ValueError(f"unknown operation {op!r}")
        out = encode(result, handle_of)
        signal.setitimer(signal.ITIMER_REAL, 0)
        return {"seq": seq, "ok": out}
    except BaseException as exc:  # SystemExit and timeouts included: the test sees them
        signal.setitimer(signal.ITIMER_REAL, 0)
        name = "TimeoutError" if isinstance(exc, _Timeout) else type(exc).__name__
        try:
            text = str(exc)[:500]
        except BaseException:
            text = "?"
        return {"seq": seq, "exc": [name, text]}


# ---- the test runner ------------------------------------------------------------------


class _Client:
    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.seq = 0

    def request(self, op: str, handle: int, *args, **kwargs):
        """Send one operation; its result, or the solution's exception raised here."""
        self.seq += 1
        msg = {"seq": self.seq, "op": op, "h": handle, "args": [_send_value(a) for a in args]}
        if kwargs:
            msg["kwargs"] = {k: _send_value(v) for k, v in kwargs.items()}
        try:
            self.chan.send(msg)
            while True:
                reply = self.chan.recv()
                if isinstance(reply, dict) and reply.get("seq") == self.seq:
                    break  # replies to calls cut short by a test's time limit are skipped
        except OSError as exc:
            self.chan.broken = f"the solution process ended ({exc})"
            raise ProtocolError(self.chan.broken) from None
        try:
            if "exc" in reply:
                name, text = reply["exc"]
                err = _exception(str(name), str(text))
            else:
                return decode(reply["ok"], _remote)
        except (KeyError, TypeError, ValueError, RecursionError, MemoryError) as exc:
            raise ProtocolError(f"bad reply from the solution: {type(exc).__name__}") from None
        raise err


_client: _Client | None = None


def _exception(name: str, text: str) -> BaseException:
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except Exception:
            pass
    return RemoteError(f"{name}: {text}")


def _send_value(value):
    def no_handles(obj):
        if isinstance(obj, Remote):
            return object.__getattribute__(obj, "_h")
        raise TypeError(f"a {type(obj).__name__} cannot be passed to the solution")

    return encode(value, no_handles)


def _remote(handle: int, type_name: str) -> Remote:
    return Remote(handle, type_name)


class Remote:
    """A solution object living in the server; operations on it are requests."""

    __slots__ = ("_h", "_t")

    def __init__(self, handle: int, type_name: str) -> None:
        object.__setattr__(self, "_h", handle)
        object.__setattr__(self, "_t", type_name)

    def _req(self, op: str, *args, **kwargs):
        assert _client is not None
        return _client.request(op, object.__getattribute__(self, "_h"), *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._req("call", *args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._req("getattr", name)

    def __setattr__(self, name: str, value) -> None:
        self._req("setattr", name, value)

    def __getitem__(self, key):
        return self._req("getitem", key)

    def __setitem__(self, key, value) -> None:
        self._req("setitem", key, value)

    def __iter__(self):
        items = self._req("list")
        return iter(items if isinstance(items, list) else [])

    def __next__(self):
        return self._req("next")

    def __len__(self) -> int:
        n = self._req("len")
        if type(n) is not int or n < 0:
            raise TypeError("len() of the solution's object is not a non-negative int")
        return n

    def __contains__(self, item) -> bool:
        return bool(self._req("contains", item) is True)

    def __bool__(self) -> bool:
        return self._req("bool") is True

    def __str__(self) -> str:
        s = self._req("str")
        return s if isinstance(s, str) else ""

    def __repr__(self) -> str:
        s = self._req("repr")
        return s if isinstance(s, str) else f"<remote {object.__getattribute__(self, '_t')}>"

    def __eq__(self, other) -> bool:  # identity only: the solution never decides equality
        return isinstance(other, Remote) and object.__getattribute__(
            other, "_h"
        ) == object.__getattribute__(self, "_h")

    def __hash__(self) -> int:
        return hash(("remote", object.__getattribute__(self, "_h")))


def _stdlib_module(name: str):
    """The runner's own stdlib module ``name`` (dotted allowed), or None."""
    top = name.split(".")[0]
    if top not in getattr(sys, "stdlib_module_names", ()) or top in _NO_IMPORT:
        return None
    try:
        return __import__(name, fromlist=["_"])
    except Exception:
        return None


def _solution_names(ready) -> dict:
    """The solution's top-level names as the runner sees them: data, :class:`Remote`
    handles, and the runner's own copy of each stdlib module the solution imported."""
    names = {}
    for name, data in dict(ready).items():
        if isinstance(data, list) and data[:1] == ["m"]:  # a module the solution imported
            module = _stdlib_module(str(data[1]))
            if module is not None:
                names[str(name)] = module
            continue
        names[str(name)] = decode(data, _remote)
    return names


def _runners_name(name: str) -> bool:
    """Whether the runner resolves ``name`` itself: a dunder, a builtin (``site``'s too,
    present or not) or a top-level stdlib module."""
    return (
        name.startswith("__")
        or hasattr(builtins, name)
        or name in _SITE_NAMES
        or name in getattr(sys, "stdlib_module_names", ())
        or name in _MODULE_ALIASES
    )


def _scanned_names(sources: list) -> tuple[set, set]:
    """(every name the test code mentions in any scope, the names it binds at module level),
    from the compiler's symbol tables (imports, defs, assignments, ``global`` included)."""
    import symtable

    mentioned, bound = set(), set()
    for source in sources:
        try:
            tables = [symtable.symtable(source, "test", "exec")]
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # the test fails when it runs
        top = tables[0]
        while tables:
            table = tables.pop()
            tables.extend(table.get_children())
            for sym in table.get_symbols():
                mentioned.add(sym.get_name())
                if (sym.is_assigned() or sym.is_imported()) and (
                    table is top or sym.is_declared_global()
                ):
                    bound.add(sym.get_name())
    return mentioned, bound


def _test_globals(sources: list, names: dict, entry_point) -> dict:
    """The globals the tests run in. A name the tests read resolves, in this order, to: the
    tests' own module-level binding (nothing is put in its place), the entry point (also as
    ``candidate``), the runner's builtin, the runner's stdlib module, and only then the
    solution's top-level name. So the solution contributes the entry point and the names
    the tests read that nothing else provides (its functions and classes), never a builtin
    or a module the tests use."""
    mentioned, bound = _scanned_names(sources)
    ns = {}
    for name in sorted(mentioned - bound):
        if entry_point is not None and name in (entry_point, "candidate"):
            ns[name] = names[entry_point]
        elif _runners_name(name):
            if name in getattr(sys, "stdlib_module_names", ()):
                module = _stdlib_module(name)
                if module is not None:
                    ns[name] = module
            elif name in _MODULE_ALIASES:
                try:
                    ns[name] = __import__(_MODULE_ALIASES[name], fromlist=["_"])
                except Exception:  # not installed where the tests run
                    pass
        elif name in names:
            ns[name] = names[name]
    return ns


def _solution_module(names: dict):
    """``import solution`` for tests that name it: every top-level name by attribute, but
    ``from solution import *`` brings none that the runner resolves itself."""
    module = type(sys)("solution")
    module.__dict__.update({k: v for k, v in names.items() if not k.startswith("__")})
    module.__all__ = [k for k in names if not k.startswith("_") and not _runners_name(k)]
    return module


def _is_unittest_module(source: str) -> bool:
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if name in ("TestCase", "IsolatedAsyncioTestCase"):
                    return True
    return False


def _run_snippet(label: str, source: str, ns: dict, per_test_s: float) -> bool:
    try:
        _alarm(per_test_s)
        exec(compile(source, label, "exec"), ns)
        return True
    except BaseException as exc:  # failing asserts, errors and timeouts alike
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stderr.write(f"[{label}] {type(exc).__name__}: {str(exc)[:300]}\n")
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _run_unittest(label: str, source: str, names: dict, per_test_s: float) -> tuple[int, int]:
    """(passed, total) of the TestCase methods a unittest-style module defines."""
    import types
    import unittest

    module = types.ModuleType("tandem_tests")
    module.__dict__.update(names)
    sys.modules["tandem_tests"] = module
    real_main = unittest.main
    unittest.main = lambda *a, **k: None  # an unguarded unittest.main() runs under us, below
    try:
        loaded = _run_snippet(label, source, module.__dict__, per_test_s)
    finally:
        unittest.main = real_main
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    total = suite.countTestCases()
    if not loaded:
        return 0, max(total, 1)

    class Counting(unittest.TestResult):
        passed = 0

        def startTest(self, test):
            super().startTest(test)
            _alarm(per_test_s)

        def stopTest(self, test):
            signal.setitimer(signal.ITIMER_REAL, 0)
            super().stopTest(test)

        def addSuccess(self, test):
            super().addSuccess(test)
            self.passed += 1

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            self.passed += 1

    result = Counting()
    try:
        suite.run(result)
    except BaseException as exc:  # a timeout in a class or module fixture
        sys.stderr.write(f"[{label}] {type(exc).__name__}: {str(exc)[:300]}\n")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    for test, trace in result.failures + result.errors:
        sys.stderr.write(f"[{label}] {test}: {trace.strip().splitlines()[-1][:300]}\n")
    return result.passed, total - len(result.skipped)


def run_tests(result_fd: int, sock_fd: int, tests: list, entry_point, per_test_s: float) -> None:
    """Run the tests against the server's solution; write the counts to ``result_fd``."""
    global _client
    _client = _Client(Channel(sock_fd))
    passed = total = 0
    try:
        _alarm(per_test_s + READY_GRACE_S)
        hello = _client.chan.recv()
        signal.setitimer(signal.ITIMER_REAL, 0)
        names = _solution_names(hello.get("ready", {}) if isinstance(hello, dict) else {})
        if isinstance(hello, dict) and hello.get("error"):
            sys.stderr.write(f"[solution] {str(hello['error'])[:300]}\n")
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stderr.write(f"[solution] did not start: {type(exc).__name__}: {exc}\n")
        names = {}
    if entry_point is not None and entry_point not in names:
        names = None  # nothing to test: every test fails
    sys.modules["solution"] = _solution_module(names or {})
    snippets = [source for source in tests if not _is_unittest_module(source)]
    ns = dict(_test_globals(snippets, names or {}, entry_point), __name__="tandem_test")
    for i, source in enumerate(tests):
        label = f"test_{i}"
        if names is None:
            p, t = 0, 1
        elif _is_unittest_module(source):
            module_ns = _test_globals([source], names, entry_point)
            p, t = _run_unittest(label, source, module_ns, per_test_s)
        else:
            p, t = int(_run_snippet(label, source, ns, per_test_s)), 1
        passed, total = passed + p, total + t
    os.write(result_fd, json.dumps({"passed": passed, "total": total}).encode())
    os._exit(0)
