"""coderai: one OpenAI-compatible endpoint over every machine you own, and a rented GPU when they are not enough."""

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import cast

__version__ = "0.1.0"


class _NatsWithoutAiohttp(importlib.abc.MetaPathFinder):
    """nats-py's transport module imports aiohttp, when it is installed, for its websocket transport alone, which
    coderai never uses (it speaks nats:// and tls://). That import costs every service process about 0.3 s on
    a quiet machine and 0.7 s on a loaded one, at every start and restart. This hides aiohttp while that one
    module loads, and only then: anything else that imports aiohttp later gets it as usual."""

    def find_spec(self, name, path=None, target=None):
        if name != "nats.aio.transport" or "aiohttp" in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        real = spec.loader.exec_module

        def exec_module(module) -> None:
            # `import aiohttp` raises ImportError: the transport goes without it (None in sys.modules means that;
            # typeshed's sys.modules holds modules only)
            cast("dict[str, ModuleType | None]", sys.modules)["aiohttp"] = None
            try:
                real(module)
            finally:
                if sys.modules.get("aiohttp", 0) is None:
                    del sys.modules["aiohttp"]

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _NatsWithoutAiohttp) for f in sys.meta_path):
    sys.meta_path.insert(0, _NatsWithoutAiohttp())
