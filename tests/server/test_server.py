"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official ``openai`` client (CPU, tiny models)."""
import concurrent.futures
import contextlib
import json
import re
import socket
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from llmkernels.engine import LLM, SamplingParams  # noqa: E402
from llmkernels.server import build_app  # noqa: E402

KEY = "sk-test"
MODEL = "tiny"
PROMPT = "The quick brown fox"


@contextlib.contextmanager
def live_server(llm, **kw):
    """Serve ``llm`` on a free loopback port in a thread; yields the base URL."""
    app = build_app(llm, model_name=MODEL, **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and th.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(timeout=30)
        sock.close()


def new_llm(path, **kw):
    kw.setdefault("max_model_len", 256)
    return LLM(path, progress=False, backend="torch", dtype=torch.float16, **kw)


@pytest.fixture(scope="module")
def served(model_files):
    """(base URL, the served LLM, the GGUF path) of one server for the module's tests."""
    _, path, _ = model_files("llama", "q8_0")
    llm = new_llm(path, max_num_seqs=8, page_size=4)
    with live_server(llm, api_key=KEY) as url:
        yield url, llm, path


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def metric(url, name):
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_models_health_and_metrics(served, client):
    url = served[0]
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200  # open without the key
    text = httpx.get(url + "/metrics").text
    for name in ("llmkernels_requests_total", "llmkernels_time_to_first_token_seconds_bucket",
                 "llmkernels_kv_cache_usage_ratio", "llmkernels_num_requests_waiting",
                 "llmkernels_time_per_output_token_seconds_count", "llmkernels_generation_tokens_total"):
        assert name in text


def test_completion_matches_generate_and_streaming_matches(served, client):
    """Greedy output through the server is LLM.generate's on the same prompt; the streamed pieces join to it."""
    _, llm, path = served
    ref = new_llm(path).generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    ids = llm.tokenizer.encode(PROMPT)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # a prompt given as token ids gives the same
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == ref.text


def test_chat_uses_the_template_and_streams_the_same(served, client, model_files):
    _, llm, path = served
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    transformers = pytest.importorskip("transformers")
    d, _, _ = model_files("llama", "q8_0")
    hf_ids = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(msgs, add_generation_prompt=True,
                                                                               tokenize=True)
    if isinstance(hf_ids, dict) or hasattr(hf_ids, "input_ids"):
        hf_ids = hf_ids["input_ids"]
    assert llm.chat_prompt(msgs) == list(hf_ids)  # the GGUF's template, rendered as transformers does
    ref = new_llm(path).chat(msgs, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(hf_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    # OpenAI's list-of-parts content
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world!"}]}]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(llm.chat_prompt([{"role": "user", "content": "Hello, world!"}]))


def test_stop_strings(served, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = r.choices[0].text
    stop = text[5:8]
    assert stop and stop not in text[:5]
    cut = text.find(stop)
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@"],
                                        stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(out)
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = out.choices[0].text, out.choices[0].finish_reason
        assert got == text[:cut] and reason == "stop"


def test_n_with_seed_is_reproducible(served, client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    ta, tb = [c.text for c in a.choices], [c.text for c in b.choices]
    assert ta == tb and [c.index for c in a.choices] == [0, 1, 2]
    assert len(set(ta)) > 1  # three draws of eight tokens each at temperature 1 differ
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == len(served[1].tokenizer.encode(PROMPT))
    streamed = {}
    for c in client.completions.create(stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert [streamed[i] for i in range(3)] == ta


def test_logprobs(served, client):
    """Each token's logprob is the log-softmax of the model's logits at its position; the top list is sorted."""
    _, llm, path = served
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    ids = llm.tokenizer.encode(PROMPT)
    out = new_llm(path).generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
    ref = torch.log_softmax(new_llm(path).logits(ids + out).double(), -1)
    want = [ref[len(ids) - 1 + i, t].item() for i, t in enumerate(out)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, want)) < 2e-2  # fp16 activations
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs):
        vals = list(top.values())
        assert len(vals) <= 3 and vals == sorted(vals, reverse=True) and abs(vals[0] - chosen) < 1e-6  # greedy
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_errors(served, client):
    url = served[0]
    h = {"Authorization": f"Bearer {KEY}"}
    bad_key = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                   headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny"}', headers=h)  # no content type
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    cases = [({"max_tokens": -1}, "max_tokens"), ({"temperature": "hot"}, "temperature"), ({"n": 0}, "n"),
             ({"logprobs": 99}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
             ({"prompt": "word " * 400}, "prompt"), ({"max_tokens": 10_000}, "max_tokens"), ({"echo": True}, "echo"),
             ({"stop": [""]}, "stop"), ({"prompt": [10**9]}, "prompt"), ({"seed": 2**70}, "seed"),
             ({"prompt": [PROMPT, "word " * 400]}, "prompt"), ({"top_k": -5}, "top_k")]
    for extra, param in cases:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, **extra}, headers=h)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="word " * 400, max_tokens=2)
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard",
                                                                                      "content": "x"}]}, headers=h)
    assert r.status_code == 400
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=h)
    assert r.status_code == 400
    assert httpx.get(url + "/v1/nothing", headers=h).status_code == 404
    assert httpx.get(url + "/health").status_code == 200  # still serving
    assert served[1].pool.num_used == 0 and not served[1].scheduler.has_work()  # nothing was left scheduled


def test_concurrent_streams_get_what_they_get_alone(served):
    """32 concurrent streaming clients, each with its own prompt and length, get exactly their solo text."""
    url = served[0]
    prompts = [f"{PROMPT} {i} " + "ab" * (i % 5) for i in range(32)]

    def one(i, stream):
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        kw = dict(model=MODEL, prompt=prompts[i], max_tokens=4 + i % 7, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return c.completions.create(**kw).choices[0].text
        return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)

    alone = [one(i, False) for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        together = list(ex.map(lambda i: one(i, True), range(32)))
    assert together == alone


def test_disconnect_frees_pages(served):
    url, llm, _ = served
    aborted = metric(url, 'llmkernels_requests_total{finish_reason="abort"}') or 0.0
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
    deadline = time.time() + 20
    while time.time() < deadline:
        if metric(url, "llmkernels_kv_cache_used_pages") == 0 and (metric(
                url, 'llmkernels_requests_total{finish_reason="abort"}') or 0) > aborted:
            break
        time.sleep(0.05)
    assert metric(url, "llmkernels_kv_cache_used_pages") == 0
    assert metric(url, 'llmkernels_requests_total{finish_reason="abort"}') == aborted + 1
    assert llm.pool.num_used == 0


def test_prefix_cache_computes_only_new_tokens(model_files):
    """A second request sharing a long prefix computes only the tokens after the cached pages; greedy outputs equal
    those of an engine without the cache."""
    _, path, _ = model_files("llama", "q8_0")
    llm = new_llm(path, page_size=4)
    base = llm.tokenizer.encode(PROMPT * 6)
    first, second = base + [5, 6, 7], base + [9, 10]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = new_llm(path, page_size=4, enable_prefix_caching=False).generate([first, second], [params, params])
    with live_server(llm) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r1 = c.completions.create(model=MODEL, prompt=first, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
        before = llm.stats.prefill_tokens
        r2 = c.completions.create(model=MODEL, prompt=second, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
        computed = llm.stats.prefill_tokens - before
    cached = len(base) // 4 * 4
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == cached and cached >= 40
    assert computed == len(second) - cached
    assert [r1.choices[0].text, r2.choices[0].text] == [o.text for o in plain]


def test_full_queue_answers_503(model_files):
    _, path, _ = model_files("llama", "q8_0")
    llm = new_llm(path, max_num_seqs=1, max_model_len=4096)
    with live_server(llm, max_queue=0) as url:  # one request in flight fills it (aborted when the test leaves)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would close the connection
            assert next(lines).startswith("data: ")
            r2 = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert r2.status_code == 503 and r2.headers["retry-after"] == "1"
            assert r2.json()["error"]["code"] == "overloaded"


def test_bounded_load(served):
    """A fixed number of requests from 16 clients within a time limit: every one answered once, none lost."""
    url, llm, _ = served
    n, t0 = 96, time.time()
    done_before = sum(metric(url, f'llmkernels_requests_total{{finish_reason="{r}"}}') or 0
                      for r in ("stop", "length"))

    def one(i):
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        r = c.completions.create(model=MODEL, prompt=f"{i} {PROMPT}", max_tokens=1 + i % 9, temperature=0.7,
                                 seed=i, stream=bool(i % 2), extra_body={"ignore_eos": True})
        if i % 2:
            return sum(1 for ch in r if ch.choices and ch.choices[0].finish_reason)
        return len(r.choices)

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(n)))
    assert results == [1] * n
    assert time.time() - t0 < 120
    done = sum(metric(url, f'llmkernels_requests_total{{finish_reason="{r}"}}') or 0 for r in ("stop", "length"))
    assert done - done_before == n
    assert llm.pool.num_used == 0


def test_serve_command(model_files, tmp_path):
    """``python -m llmkernels serve`` as users start it: a chat template file, a served name, curl-style calls."""
    import subprocess
    import sys

    _, path, _ = model_files("llama", "q8_0")
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "llmkernels", "serve", path, "--port", str(port), "--backend", "torch",
           "--served-model-name", "m", "--chat-template", str(tpl), "--max-model-len", "128", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "serve did not come up"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 3,
                                                           "messages": [{"role": "user", "content": "Hello"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        want = new_llm(path).tokenizer.encode("Hello\n", add_bos=False)  # through the template file, no BOS
        assert r.json()["usage"]["prompt_tokens"] == len(want)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("args,message", [
    (["/nonexistent.gguf"], "is not a file"),
    (["{model}", "--port", "0"], "--port must be in 1..65535"),
    (["{model}", "--chat-template", "/nonexistent.jinja"], "--chat-template"),
])
def test_serve_command_errors(model_files, capsys, args, message):
    from llmkernels.__main__ import main

    _, path, _ = model_files("llama", "q8_0")
    assert main(["serve", *[a.format(model=path) for a in args]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_server_over_tensor_parallel_engine(model_files):
    """The server drives a TP = 2 engine (gloo on the CPU) and answers what the TP = 1 engine generates."""
    _, path, _ = model_files("llama", "q8_0", hidden=512, heads=8, kv_heads=2, head_dim=64, ffn=1024)
    want = new_llm(path).generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text
    with new_llm(path, tensor_parallel_size=2) as llm, live_server(llm) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == want


def test_harmony_chat_reasoning_apart(model_files, monkeypatch):
    """A gpt-oss (harmony) chat reply: message.content is the final channel and message.reasoning_content the
    analysis, streamed as deltas of each that join to LLM.chat's; completions keep the raw text. The sampler is
    scripted (a random model writes no harmony), one request at a time."""
    from tests.harmony_script import OSS, reply, script_sampler

    _, path, _ = model_files("gpt_oss", "f32", **OSS)
    llm = new_llm(path, max_num_seqs=2)
    tok = llm.tokenizer
    ids = reply(tok, ["<|channel|>", "analysis", "<|message|>", "Let me think.", "<|end|>", "<|start|>", "assistant",
                      "<|channel|>", "final", "<|message|>", "Hello, world!", "<|return|>"])
    made = script_sampler(monkeypatch, ids)
    msgs = [{"role": "user", "content": "Hi"}]
    with live_server(llm) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50)
        m = r.choices[0].message
        assert (m.content, m.model_extra["reasoning_content"]) == ("Hello, world!", "Let me think.")
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(ids)
        made.clear()
        chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(d.content or "" for d in deltas) == "Hello, world!"
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Let me think."
        made.clear()
        raw = c.completions.create(model=MODEL, prompt=llm.chat_prompt(msgs), max_tokens=50)
        assert "Let me think." in raw.choices[0].text and "Hello, world!" in raw.choices[0].text
        # OpenAI's reasoning_effort and vLLM's chat_template_kwargs reach the template
        made.clear()
        high = llm.chat_prompt(msgs, True, {"reasoning_effort": "high"})
        assert "Reasoning: high" in tok.decode(high) and len(high) > len(llm.chat_prompt(msgs))
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50, reasoning_effort="high")
        assert r.usage.prompt_tokens == len(high)
        made.clear()
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50,
                                      extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
        assert r.usage.prompt_tokens == len(high)
        bad = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs,
                                                             "reasoning_effort": "extreme"})
        assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]
        bad = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs,
                                                             "chat_template_kwargs": {"messages": 1}})
        assert bad.status_code == 400 and "variable names" in bad.json()["error"]["message"]


def test_harmony_tool_calls(model_files, monkeypatch):
    """Tools on a harmony model: the call comes back as message.tool_calls (finish_reason "tool_calls"), streamed as
    tool-call deltas that join to the same; tools on a model without harmony, a forced tool_choice and a malformed
    tool are refused with 400. The sampler is scripted."""
    from tests.harmony_script import OSS, reply, script_sampler

    _, path, _ = model_files("gpt_oss", "f32", **OSS)
    llm = new_llm(path, max_num_seqs=2, max_model_len=512)
    tok = llm.tokenizer
    ids = reply(tok, ["<|channel|>", "analysis", "<|message|>", "Call it.", "<|end|>", "<|start|>", "assistant",
                      " to=functions.get_weather", "<|channel|>", "commentary json", "<|message|>",
                      '{"city": "Paris"}', "<|call|>"])
    made = script_sampler(monkeypatch, ids)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    with live_server(llm) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        call = ch.message.tool_calls[0]
        assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather",
                                                                             '{"city": "Paris"}')
        assert call.id.startswith("call_") and ch.message.model_extra["reasoning_content"] == "Call it."
        assert r.usage.prompt_tokens == len(llm.chat_prompt(msgs, True, {"tools": tools}))
        made.clear()
        chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, tools=tools,
                                                stream=True))
        parts = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        assert parts[0].id.startswith("call_") and parts[0].function.name == "get_weather"
        assert "".join(p.function.arguments or "" for p in parts) == '{"city": "Paris"}'
        assert {p.index for p in parts} == {0}
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        # the call answered: the follow-up turn renders (arguments parsed, not encoded twice)
        made.clear()
        turn = msgs + [ch.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "sunny"}]
        r = c.chat.completions.create(model=MODEL, messages=turn, tools=tools)
        want = llm.chat_prompt(turn, True, {"tools": tools})
        assert r.usage.prompt_tokens == len(want)
        assert '<|message|>{"city": "Paris"}<|call|>' in tok.decode(want, skip_special_tokens=False)
        for body, word in [({"tool_choice": "required"}, "tool_choice"),
                           ({"tools": [{"type": "function", "function": {}}]}, "tools[0]")]:
            bad = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "tools": tools,
                                                                 **body})
            assert bad.status_code == 400 and word in bad.json()["error"]["message"]


def test_tools_refused_without_harmony(served):
    url = served[0]
    bad = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                           "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert bad.status_code == 400 and "harmony" in bad.json()["error"]["message"]
