"""The llama-server engine's pure parts: the flags a models-file entry becomes, and the slot load it reads."""

from __future__ import annotations

from coderai.contracts import ModelConfig
from coderai.engine_worker.engines.llama_server import LlamaServerEngine, default_cache_ram_mb, server_args, slot_load


def _cfg(**params) -> ModelConfig:
    return ModelConfig(name="qwen", engine="llama-server", path="/models/q.gguf", params=params)


def test_defaults_give_slots_a_context_each_and_every_layer_on_the_gpu():
    args = server_args(_cfg(), 4321)
    flag = {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}
    assert flag["--model"] == "/models/q.gguf" and flag["--alias"] == "qwen"
    assert (flag["--host"], flag["--port"]) == ("127.0.0.1", "4321")
    assert (flag["--parallel"], flag["--ctx-size"]) == ("4", str(4 * 2048))
    assert flag["--n-gpu-layers"] == "999" and flag["--cache-ram"] == str(default_cache_ram_mb())
    assert {"--jinja", "--metrics", "--slots", "--no-webui"} <= set(args)
    args = server_args(_cfg(cache_ram_mb=0), 1)
    assert args[args.index("--cache-ram") + 1] == "0"  # a model's own size wins, off included


def test_the_prompt_cache_is_a_share_of_the_node_memory_within_bounds():
    gib = 1 << 30
    assert default_cache_ram_mb(24 * gib) == 768  # this CI machine: 1/32 of 24 GiB
    assert default_cache_ram_mb(1 * gib) == 64 and default_cache_ram_mb(512 * gib) == 1024
    assert default_cache_ram_mb(0) == 64  # memory unknown


def test_named_params_and_the_rest_as_flags():
    args = server_args(
        _cfg(
            parallel=8,
            n_ctx=4096,
            n_gpu_layers=10,
            n_threads=2,
            mmproj="~/p.gguf",
            flash_attn=True,
            top_k=5,
            no_mmap=False,
            extra_args=["--verbose"],
            env={"A": "1"},
            queue=2,
        ),
        1,
    )
    flag = {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}
    assert (flag["--parallel"], flag["--ctx-size"], flag["--n-gpu-layers"], flag["--threads"]) == (
        "8",
        "32768",
        "10",
        "2",
    )
    assert flag["--mmproj"].endswith("/p.gguf") and not flag["--mmproj"].startswith("~")
    assert "--flash-attn" in args and flag["--top-k"] == "5" and "--no-mmap" not in args
    assert args[-1] == "--verbose" and "--env" not in args and "--queue" not in args


def test_the_queue_bound_is_a_memory_bound_unless_set():
    e = LlamaServerEngine(_cfg(parallel=2))
    assert (e.slots, e.queue_limit, e.max_concurrency) == (2, 258, 2)  # one engine thread a slot; the rest queue here
    assert LlamaServerEngine(_cfg(parallel=2, queue=0)).queue_limit == 2


def test_slot_load_reads_running_and_deferred_requests():
    text = "# HELP x\nllamacpp:requests_processing 3\nllamacpp:requests_deferred 5\nllamacpp:n_decode_total 9\n"
    assert slot_load(text) == (3, 5)
    assert slot_load("") == (0, 0)


def test_the_backend_and_offloaded_layers_come_from_the_start_log():
    from coderai.engine_worker.engines.llama_server import offload_of

    cuda = (
        "ggml_cuda_init: found 1 CUDA devices:\n  Device 0: NVIDIA H200, compute capability 9.0, VMM: yes\n"
        "llama_model_load_from_file_impl: using device CUDA0 (NVIDIA H200) - 139812 MiB free\n"
        "load_tensors: offloading 18 repeating layers to GPU\nload_tensors: offloaded 19/19 layers to GPU\n"
    )
    assert offload_of(cuda) == ("cuda", 19)
    assert offload_of("load_tensors: offloaded 19/19 layers to GPU\nggml_vulkan_init: found 1 Vulkan devices") == (
        "vulkan",
        19,
    )
    assert offload_of("srv load_model: loading model\nload_tensors: CPU_Mapped model buffer size = 1.2 MiB\n") == (
        "cpu",
        0,
    )
    assert offload_of("load_tensors: offloaded 0/19 layers to GPU\nggml_cuda_init: found 1 CUDA devices") == ("cpu", 0)


def test_an_embedding_model_is_started_in_embedding_mode():
    cfg = ModelConfig(name="e", engine="llama-server", path="/e.gguf", ops=["embed"], params={"pooling": "cls"})
    args = server_args(cfg, 1)
    assert "--embedding" in args and args[args.index("--pooling") + 1] == "cls"
    no_file = server_args(ModelConfig(name="e", engine="llama-server", path="/none.gguf", ops=["embed"]), 1)
    assert no_file[no_file.index("--pooling") + 1] == "mean"  # unreadable or unnamed: mean
    assert "--embedding" not in server_args(_cfg(), 1)


def test_a_quiet_build_s_offload_is_what_it_was_asked_on_the_devices_it_lists(tmp_path, tiny_gguf):
    """llama.cpp from 0.5 logs neither device nor offload at its default verbosity: the engine then says what the
    build can do (the first GPU device `--list-devices` names) with the layers it asked for."""
    from coderai.contracts import ModelConfig
    from coderai.engine_worker.engines.llama_server_args import offload
    from coderai.runtime.embedded import find_llama_server
    from coderai.runtime.gguf_meta import block_count

    vulkan = tmp_path / "llama-server-vulkan"
    vulkan.write_text(
        "#!/bin/sh\necho 'Available devices:'\necho '  Vulkan0: llvmpipe (LLVM 15) (2048 MiB, 2048 MiB free)'\n"
    )
    vulkan.chmod(0o755)
    quiet_log = "srv load_model: loading model\nsrv llama_server: model loaded\n"
    blocks = block_count(tiny_gguf)
    assert blocks > 0

    def cfg(**params) -> ModelConfig:
        return ModelConfig(name="m", engine="llama-server", path=str(tiny_gguf), params=params)

    assert offload(cfg(), quiet_log, str(vulkan), {}) == ("vulkan", blocks + 1)  # all: its blocks and the output
    assert offload(cfg(n_gpu_layers=1), quiet_log, str(vulkan), {"GGML_VK_VISIBLE_DEVICES": "0"}) == ("vulkan", 1)
    assert offload(cfg(n_gpu_layers=0), quiet_log, str(vulkan), {}) == ("cpu", 0)  # asked for none
    said = "load_tensors: offloaded 3/19 layers to GPU\nusing device CUDA0 (x)"
    assert offload(cfg(), said, str(vulkan), {}) == ("cuda", 3)  # the log's word wins where it speaks
    cpu_build = find_llama_server()
    assert cpu_build is not None and offload(cfg(), quiet_log, cpu_build, {}) == ("cpu", 0)  # lists no GPU
