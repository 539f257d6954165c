"""One compile-pool worker (see compile_pool.py), run as a script: ``python compile_worker.py``.

Standard library only, and not imported through the ``aotforge`` package: a worker starts in
milliseconds and imports only what its jobs need (torch and Triton, for kernel compiles).

The wire: each message is an 8-byte little-endian length and a pickle. The parent sends its
``sys.path`` first (so that the worker imports the same modules), then a list of modules to
import at once, then jobs, each a pickle of
``(function, arguments)``; the worker answers each with ``(ok, result or error text)``.
"""
import importlib
import os
import pickle
import struct
import sys

HEADER = struct.Struct("<Q")


def send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream):
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError("the other end closed the pipe")
    (length,) = HEADER.unpack(header)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("the other end closed the pipe mid-message")
    return pickle.loads(data)


def main() -> None:
    requests = sys.stdin.buffer
    # Replies get a private copy of stdout; whatever jobs print goes to stderr, so that a
    # stray print (Triton's warnings) cannot corrupt a reply.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.path[:] = receive(requests)
    for name in receive(requests):  # modules every job needs: imported at boot, not by job one
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  a job that needs it reports the error
            pass
    while True:
        try:
            payload = receive(requests)
        except EOFError:
            return  # the parent closed the pool (or exited)
        try:
            function, arguments = pickle.loads(payload)
            reply = (True, function(*arguments))
        except BaseException as error:  # noqa: BLE001  every failure is reported to the parent
            reply = (False, f"{type(error).__name__}: {error}")
        try:
            send(replies, reply)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            send(replies, (False, f"the job's result cannot be sent back: {error}"))


if __name__ == "__main__":
    main()
