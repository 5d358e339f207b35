#!/usr/bin/env python3
"""Talks to `ridgefill serve` with the official `openai` client: a chat completion, a streamed
one, one reusing the first's cached system prompt, and a bad request. Usage: openai_client_check.py BASE_URL (e.g. http://127.0.0.1:8080/v1).
Run by tests/serve.rs when RIDGEFILL_PYTHON names an interpreter with `openai` installed."""
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=300)
messages = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]

r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
plain = r.choices[0].message.content
assert "Paris" in plain, plain
assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 5, r.usage

# A long system prompt twice: the second request takes its tokens from the first's cache.
system = {"role": "system", "content": "You are a helpful assistant who answers briefly. " * 12}
for city in ["France", "Italy"]:
    ask = [system, {"role": "user", "content": f"What is the capital of {city}?"}]
    r2 = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=4, temperature=0)
cached = r2.usage.prompt_tokens_details.cached_tokens
assert 0 < cached < r2.usage.prompt_tokens, r2.usage

parts = []
for chunk in client.chat.completions.create(
    model="smollm2", messages=messages, max_tokens=12, temperature=0, stream=True
):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
assert "".join(parts) == plain, ("".join(parts), plain)

try:
    client.chat.completions.create(model="smollm2", messages=[], max_tokens=4)
    raise AssertionError("an empty message list was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "empty" in str(e), e

t = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0)
assert "Paris" in t.choices[0].text, t.choices[0].text
print("openai", openai.__version__, "ok:", repr(plain), f"cached_tokens {cached}")
