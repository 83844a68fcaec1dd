"""The official `openai` and `ollama` Python packages against a Shoal node's API.

Usage: clients.py BASE_URL MODEL PROMPT EXPECTED_TEXT N
EXPECTED_TEXT is the unsplit model's greedy answer of N tokens (`shoal run`); every
greedy answer below must equal it (or its stated prefix). Exits non-zero on the first
difference, saying what differed.
"""

import sys

import ollama
import openai

base, model, prompt, expected, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
messages = [{"role": "user", "content": prompt}]


def check(what, got, want):
    if got != want:
        sys.exit(f"{what}: got {got!r}, want {want!r}")
    print(f"ok  {what}")


oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-loopback")

# Whole and streamed (with the usage chunk), greedy: the unsplit model's text.
r = oa.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=n)
check("openai whole text", r.choices[0].message.content, expected)
check("openai whole finish_reason", r.choices[0].finish_reason, "length")
check("openai whole usage", r.usage.completion_tokens, n)

chunks = list(
    oa.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=n, stream=True,
        stream_options={"include_usage": True},
    )
)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check("openai stream text", text, expected)
check("openai stream finish_reason", [c.choices[0].finish_reason for c in chunks if c.choices][-1], "length")
check("openai stream usage chunk", (chunks[-1].choices, chunks[-1].usage.completion_tokens), ([], n))

# max_tokens honoured; a stop sequence cuts the text before it.
r = oa.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=5)
check("openai max_tokens", (r.choices[0].finish_reason, r.usage.completion_tokens), ("length", 5))
check("openai max_tokens prefix", expected.startswith(r.choices[0].message.content), True)
words = expected.split()
stop = words[len(words) // 2]
r = oa.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=n, stop=[stop])
check("openai stop", (r.choices[0].message.content, r.choices[0].finish_reason),
      (expected[: expected.index(stop)], "stop"))

try:
    oa.chat.completions.create(model="no-such-model", messages=messages)
    sys.exit("openai unknown model: no error")
except openai.NotFoundError as e:
    print(f"ok  openai unknown model -> NotFoundError ({e.status_code})")

# Ollama's client: the same text, streamed and whole.
ol = ollama.Client(host=base)
parts = ol.chat(model=model, messages=messages, options={"temperature": 0, "num_predict": n}, stream=True)
text = ""
last = None
for p in parts:
    text += p.message.content
    last = p
check("ollama stream text", text, expected)
check("ollama stream end", (last.done, last.done_reason, last.eval_count), (True, "length", n))
r = ol.chat(model=model, messages=messages, options={"temperature": 0, "num_predict": n})
check("ollama whole text", r.message.content, expected)
names = [m.model for m in ol.list().models]
check("ollama list", model in names, True)
try:
    ol.chat(model="no-such-model", messages=messages)
    sys.exit("ollama unknown model: no error")
except ollama.ResponseError as e:
    check("ollama unknown model status", e.status_code, 404)
print("all client checks passed")
