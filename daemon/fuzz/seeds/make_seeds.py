#!/usr/bin/env python3
"""Writes the hand-made seed inputs of every fuzz target except gguf (whose seeds come
from `cargo run -p shoal-gguf --example fuzz_seeds`): a few valid inputs each, in the
byte layout each target expects (see the comments in fuzz_targets/)."""
import json, os, struct

HERE = os.path.dirname(os.path.abspath(__file__))
A, B = "a" * 64, "b" * 64
CL = "c" * 32


def write(target, name, data):
    d = os.path.join(HERE, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# frame: the 40-byte header (shoal-net/src/frame.rs) and a payload; the target's
# limits are n_embd 8, max_tokens 16, max_message 4096.
def frame(kind, dtype, n_tokens, payload):
    return (b"SF" + bytes([2, kind]) + struct.pack("<QIIII", 7, 3, 1, 10, n_tokens)
            + bytes([dtype, 0, 0, 0]) + struct.pack("<II", len(payload), 12345) + payload)


write("frame", "hidden_f32", frame(2, 2, 1, struct.pack("<8f", *range(8))))
write("frame", "hidden_f16", frame(2, 3, 2, bytes(32)))
write("frame", "token", frame(3, 1, 1, struct.pack("<i", 42)))
write("frame", "token_logprobs", frame(3, 0, 1, struct.pack("<ifif", 42, -0.5, 42, -0.5)))
write("frame", "open", frame(1, 0, 0, b'{"max_tokens":4}'))
write("frame", "close", frame(4, 0, 0, b""))

# membership_msg: one byte picking the type (0 Msg, 1 JoinRequest, 2 JoinResponse,
# 3 AdminRequest, 4 AdminResponse, 5 PublicInfo), then the JSON body.
member = {"id": A, "name": "box", "role": "pc", "memory_bytes": 1 << 30}
state = {"cluster": CL, "owner": A, "version": {"term": 1, "index": 2},
         "members": {A: member}, "revoked": [B], "entries": {"placement/x": {"n": 1}}}
info = {"node": A, "cluster": None, "name": "box", "role": "hub", "memory_bytes": 1 << 33,
        "accepts_approval": True}
msgs = [
    (0, {"Beat": {"term": 3, "leader": True, "version": {"term": 3, "index": 9}}}),
    (0, {"State": {"term": 3, "state": state}}),
    (0, {"Forward": {"req": 1, "proposal": {"Owner": {"action": "approve box", "change": {"AddMember": member}}}}}),
    (0, {"Forwarded": {"req": 1, "result": {"Err": {"Invalid": {"NotMember": B}}}}}),
    (1, "hello"),
    (1, {"pair_start": {"msg": list(range(33)), "info": info}}),
    (1, {"welcome": {"state": state}}),
    (2, {"info": info}),
    (2, {"pair_reply": {"msg": list(range(65))}}),
    (3, {"put": {"key": "k", "value": [1, {"a": None}]}}),
    (3, {"calibrate": {"model": "/m.gguf", "tokens": 16, "threads": 4}}),
    (4, {"entries": {"k": 1.5}}),
    (4, {"code": {"code": "1234-5678", "valid_s": 300}}),
    (5, info),
]
for i, (which, body) in enumerate(msgs):
    write("membership_msg", f"msg-{i}", bytes([which]) + json.dumps(body).encode())

# pairing: one byte picking the side (0 member, 1 joiner, 2 code text), then the rest.
write("pairing", "respond", bytes([0]) + bytes(range(33)) + bytes(32))
write("pairing", "finish", bytes([1]) + bytes(range(65)))
write("pairing", "code-dash", b"\x021234-5678")
write("pairing", "code-plain", b"\x02 12345678 ")

# txt: the SRV port (u16, big endian), then TXT RDATA (length-prefixed strings).
props = [("id", A), ("pv", "1"), ("cl", CL), ("jp", "7102"), ("ram", "8000000000"),
         ("vram", "0"), ("dev", "8c/31G"), ("role", "pc"), ("ver", "0.1.0")]
rdata = b"".join(bytes([len(f"{k}={v}")]) + f"{k}={v}".encode() for k, v in props)
write("txt", "advert", struct.pack(">H", 7101) + rdata)
props[2] = ("cl", "unpaired")
rdata = b"".join(bytes([len(f"{k}={v}")]) + f"{k}={v}".encode() for k, v in props)
write("txt", "unpaired", struct.pack(">H", 7101) + rdata)

# placement and profile: TOML text.
write("placement", "two-stages", f'''model = "m.gguf"
context = 1024
chunk = 32
sessions = 2
clients = ["{"c" * 64}"]

[[stage]]
node = "{A}"
addr = "127.0.0.1:7101"
layers = [0, 10]

[[stage]]
node = "{B}"
addr = "[::1]:7102"
layers = [10, 30]
''')
write("profile", "sizes", '''[model]
layers = 4
layer_bytes = 100
head_bytes = 10
embed_bytes = 10
n_embd = 8
kv_bytes_per_token_per_layer = 2
context = 64

[[device]]
id = "a/cpu"
host = "a"
memory_bytes = 1_000_000
ms_per_layer = 1.0
prefill_ms_per_layer_token = 0.4
wake_ms = 3.0

[[device]]
id = "b/gpu0"
host = "b"
memory_bytes = 8_000_000
ms_per_layer = 0.1
keepalive = true

[[link]]
hosts = ["a", "b"]
ms_per_frame = 0.2
mbit_per_s = 940.0
''')
write("profile", "path", '''[model]
path = "/models/m.gguf"

[[device]]
id = "a/cpu"
host = "a"
memory_bytes = 1
ms_per_layer = 1.0
''')

# http_body: one byte picking the route (0 chat/completions, 1 completions, 2 messages,
# 3 api/chat, 4 api/generate, 5 api/show, 6 api/pull, 7 DELETE api/delete), then the body.
schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a"]}
bodies = [
    (0, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
         "temperature": 0, "stop": ["}"], "stream": True, "stream_options": {"include_usage": True}}),
    (0, {"model": "tiny", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "x"}]}], "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "n", "schema": schema}}}),
    (1, {"model": "tiny", "prompt": "abc", "max_tokens": 3, "seed": 7, "top_p": 0.5}),
    (2, {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    (3, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "format": schema,
         "options": {"num_predict": 3, "stop": ["a"], "repeat_penalty": 1.1}}),
    (3, {"model": "tiny", "messages": [], "keep_alive": 0}),
    (4, {"model": "tiny", "prompt": "abc", "raw": True, "stream": False, "format": "json"}),
    (5, {"model": "tiny"}),
    (6, {"model": "hf://org/repo/file.gguf", "stream": True}),
    (7, {"model": "tiny"}),
    (0, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
         "top_logprobs": 3, "stream": True}),
    (1, {"model": "tiny", "prompt": "abc", "logprobs": 2}),
]
for i, (route, body) in enumerate(bodies):
    write("http_body", f"route{route}-{i}", bytes([route]) + json.dumps(body).encode())

# template: a first byte whose low bit says raw template text (0) or choices for the
# target's grammar (1); real templates' shapes as raw text, and a few grammar walks.
write("template", "chatml", b"\x00{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
write("template", "tools_json", b"\x00{% if tools %}{{ tools | tojson(indent=4) }}{% endif %}{% for m in messages %}{{ m.content | indent(2, first=true) }}{% endfor %}")
write("template", "nested_loops", b"\x01" + bytes([0, 2, 1, 0xa0, 0x86, 0, 2, 1, 0xa0, 0x86, 0, 1]))
write("template", "recursion", b"\x01" + bytes([0, 3, 0, 200, 6, 1]))
write("template", "wide", b"\x01" + bytes([2, 4, 2, 0xff, 0xff, 0xff, 0x7f, 5, 1, 0xff, 0xff, 11, 2, 0, 0, 0, 1]))
