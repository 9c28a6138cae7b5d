"""The words the benches build their prompts and documents from (a small, fixed vocabulary: runs repeat)."""

WORDS = (
    "cache",
    "routing",
    "engine",
    "token",
    "prefix",
    "replica",
    "latency",
    "cluster",
    "model",
    "stream",
    "queue",
    "budget",
    "memory",
    "worker",
    "gateway",
    "router",
    "bus",
    "prompt",
    "turn",
    "answer",
)
