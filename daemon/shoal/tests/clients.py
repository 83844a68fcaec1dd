"""The official `openai` and `ollama` Python packages against a Shoal node's API.

Usage: clients.py BASE_URL MODEL PROMPT EXPECTED_TEXT N
EXPECTED_TEXT is the unsplit model's greedy answer of N tokens (`shoal run`); every
greedy answer below must equal it (or its stated prefix). Exits non-zero on the first
difference, saying what differed.
"""

import json
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

# Tools: any model calls them (Shoal describes them in the system message and a
# grammar holds the answer to a call); the clients parse the calls.
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
r = oa.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                               temperature=0, max_tokens=100)
call = r.choices[0].message.tool_calls[0]
args = json.loads(call.function.arguments)
check("openai tool call", (r.choices[0].finish_reason, call.type, call.function.name, list(args)),
      ("tool_calls", "function", "get_weather", ["city", "unit"]))
check("openai tool call arguments", (isinstance(args["city"], str), args["unit"] in ("celsius", "fahrenheit")),
      (True, True))
chunks = list(oa.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                         temperature=0, max_tokens=100, stream=True))
deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
# Clients join a call's deltas by its index; the greedy stream makes the same calls.
streamed = {}
for d in deltas:
    name, text = streamed.get(d.index, ("", ""))
    streamed[d.index] = (name + (d.function.name or ""), text + (d.function.arguments or ""))
whole = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
check("openai streamed tool calls", [(n, json.loads(a)) for _, (n, a) in sorted(streamed.items())], whole)
# The conversation goes on with the tool's result; tool_choice none: a text answer.
follow = ask + [
    {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function",
                                          "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"},
]
r = oa.chat.completions.create(model=model, messages=follow, tools=tools, tool_choice="none",
                               temperature=0, max_tokens=16)
check("openai answer after the tool", (r.choices[0].message.tool_calls, bool(r.choices[0].message.content)),
      (None, True))
# Ollama's client: tools without tool_choice, the model decides; a call's arguments
# come as an object.
r = ol.chat(model=model, messages=ask, tools=tools, options={"temperature": 0, "num_predict": 100})
if r.message.tool_calls:
    f = r.message.tool_calls[0].function
    check("ollama tool call", (f.name, sorted(f.arguments)), ("get_weather", ["city", "unit"]))
else:
    check("ollama reply instead of a call", bool(r.message.content), True)
print("all client checks passed")
