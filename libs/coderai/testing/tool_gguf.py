"""An overfitted tiny llama GGUF that calls a tool by itself, through llama.cpp's own tool-call parsing.

A random-weight model never chooses a tool. This one is trained (torch, seconds on two cores) on the tiny GGUF's
tokenizer and a Qwen 2.5-style ChatML template with tools, so that, offered the `get_weather` tool:
- a user message that asks about the weather is answered with `<tool_call>{"name": "get_weather", "arguments":
  {"city": "Paris"}}</tool_call>`, which `llama-server --jinja` turns into OpenAI `tool_calls`;
- any other message is answered with the text REPLY.
Prompts are rendered by the template with jinja2 and tokenized by llama.cpp itself (a vocab-only load), so the
token ids trained on are the ones the server feeds. Needs `torch`, `transformers`, `gguf`, `llama_cpp`.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from coderai.tiny_models.cache import cached_build

RECIPE_VERSION = "1"
REPLY = "Hello! How can I help?"
CITY = "Paris"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"name": "get_weather", "arguments": {"city": CITY}}
DIM, LAYERS, HEADS = 64, 2, 4

# Qwen 2.5's ChatML template with tools: llama.cpp's autoparser reads `<tool_call>` JSON calls from it
TOOLS_CHATML = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_WORDS = (
    "hi hello what is the tell me a joke please explain python code ping test who are you today "
    "how do i sort list thanks good morning name story"
).split()


def _user_messages(rng: random.Random) -> tuple[list[str], list[str]]:
    """(weather questions, other messages): varied, so the model keys on the weather question, not a prompt."""
    weather = [
        "what is the weather in Paris",
        "weather in Paris?",
        "What's the weather like in Paris today?",
        "tell me the weather in Paris",
        "is it raining in Paris? check the weather",
        "Paris weather",
    ]
    for _ in range(24):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(0, 6))]
        words.insert(rng.randint(0, len(words)), rng.choice(["weather in Paris", "the weather in Paris"]))
        weather.append(" ".join(words))
    other = ["hello", "hi", "say something", "what is python", "tell me a joke", "who are you", "ping"]
    for _ in range(24):
        other.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 10))))
    return weather, other


def _samples(vocab, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    import jinja2

    env = jinja2.Environment()
    env.filters["tojson"] = lambda v: json.dumps(v)
    tmpl = env.from_string(TOOLS_CHATML)
    eos = vocab.token_eos()

    def ids(text: str, special: bool) -> list[int]:
        return vocab.tokenize(text.encode(), add_bos=False, special=special)

    call_text = "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"
    weather, other = _user_messages(rng)
    out = []
    for user, reply, tools in (
        [(u, call_text, True) for u in weather]
        + [(u, REPLY, True) for u in other]
        + [(u, REPLY, False) for u in weather + other]
    ):
        for system in (None, "You are a test model."):
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
            prompt = tmpl.render(messages=msgs, tools=[TOOL] if tools else None, add_generation_prompt=True)
            out.append((ids(prompt, True), ids(reply, False) + [eos]))
    return out


def _train(samples, n_vocab: int, steps: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    cfg = LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=DIM,
        intermediate_size=4 * DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3)
    model.train()
    batch_size = 8
    for _ in range(steps):
        batch = rng.sample(samples, batch_size)
        length = max(len(p) + len(r) for p, r in batch)
        ids = torch.zeros((batch_size, length), dtype=torch.long)
        labels = torch.full((batch_size, length), -100)
        mask = torch.zeros((batch_size, length), dtype=torch.long)
        for b, (p, r) in enumerate(batch):
            seq = p + r
            ids[b, : len(seq)] = torch.tensor(seq)
            labels[b, len(p) : len(seq)] = torch.tensor(r)
            mask[b, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    return model, float(loss.detach())


def build_tool_gguf(out: str | os.PathLike, *, steps: int = 200, seed: int = 0) -> dict:
    """Train the model and write it to `out`; returns {"out", "loss"}."""
    from llama_cpp import Llama

    from coderai.tiny_models.llm import build_tiny_gguf, weights_from_hf

    out = Path(out)
    build_tiny_gguf(out, dim=DIM, layers=LAYERS, heads=HEADS, chat_template=TOOLS_CHATML)  # its tokenizer
    vocab = Llama(str(out), vocab_only=True, verbose=False)
    samples = _samples(vocab, random.Random(seed))
    model, loss = _train(samples, vocab.n_vocab(), steps, seed)
    del vocab
    build_tiny_gguf(
        out,
        dim=DIM,
        layers=LAYERS,
        heads=HEADS,
        chat_template=TOOLS_CHATML,
        weights=weights_from_hf(model.state_dict(), HEADS, HEADS),
        name="coderai-tiny-tools",
    )
    return {"out": str(out), "loss": loss}


def tool_gguf() -> Path:
    """The model, built once into the model cache."""
    folder = cached_build("tiny-tools-gguf", RECIPE_VERSION, lambda d: build_tool_gguf(d / "tools.gguf"))
    return folder / "tools.gguf"


if __name__ == "__main__":
    import sys

    print(json.dumps(build_tool_gguf(sys.argv[1])))
