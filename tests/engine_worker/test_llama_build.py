"""The llama.cpp that `scripts/setup` installed is the portable build (AVX2, FMA, F16C; no AVX-512) unless
a native one was asked for (CODERAI_LLAMA_NATIVE=1) and passed its smoke run on a real K-quant model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def test_llama_cpp_is_built_portable_unless_a_native_build_passed_its_smoke_run():
    llama_cpp = pytest.importorskip("llama_cpp")
    info = llama_cpp.llama_print_system_info().decode()
    assert "AVX2 = 1" in info and "FMA = 1" in info, info
    venv = Path(sys.prefix)
    smoked = (venv / ".llama-smoke").exists() and (venv / ".llama-smoke").read_text() == (
        venv / ".llama-build"
    ).read_text()
    if not smoked:
        assert "AVX512" not in info, f"a native llama.cpp build without a passed smoke run: {info}"
