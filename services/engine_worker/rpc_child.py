"""A ggml RPC server in a process of its own: `python -m coderai.engine_worker.rpc_child HOST:PORT [THREADS]`.

llama-cpp-python ships `libggml-rpc` but no `rpc-server` program, so the server is started through ctypes
from the same libraries the engine uses (so both ends speak the same RPC protocol version). It prints one
JSON line (`{"device", "mem_total", "mem_free"}`) once it is about to listen, then serves until killed.
ggml RPC has no authentication: the worker binds this to loopback only and lets peers in through its gate.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys


def libraries() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libggml and libggml-rpc from the installed llama-cpp-python, by the names its own loader uses."""
    import llama_cpp  # loads libllama and libggml first

    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    ggml = ctypes.CDLL(os.path.join(libdir, "libggml.so.0"), mode=ctypes.RTLD_GLOBAL)
    rpc = ctypes.CDLL(os.path.join(libdir, "libggml-rpc.so.0"), mode=ctypes.RTLD_GLOBAL)
    return ggml, rpc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    endpoint = args[0]
    threads = int(args[1]) if len(args) > 1 else max(1, os.cpu_count() or 1)
    ggml, rpc = libraries()
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_description.restype = ctypes.c_char_p
    ggml.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_memory.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        print(json.dumps({"error": "ggml has no CPU device"}), flush=True)
        return 1
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    desc = (ggml.ggml_backend_dev_description(dev) or b"CPU").decode("utf-8", "replace")
    print(json.dumps({"device": desc, "mem_total": total.value, "mem_free": free.value}), flush=True)
    devices = (ctypes.c_void_p * 1)(dev)
    rpc.ggml_backend_rpc_start_server.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_start_server(endpoint.encode(), None, threads, 1, devices)  # blocks
    return 0


if __name__ == "__main__":
    sys.exit(main())
