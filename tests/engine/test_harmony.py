"""gpt-oss's harmony replies split into reasoning and text: the parser on token ids, LLM.chat, and the end-of-reply
tokens (CPU, the tiny gpt-oss model's tokenizer)."""
import pytest

from llmkernels.engine import LLM, SamplingParams
from llmkernels.engine.harmony import HarmonyStream, harmony_ids
from tests.harmony_script import OSS, reply, script_sampler



@pytest.fixture(scope="module")
def oss(model_files):
    _, path, _ = model_files("gpt_oss", "f32", **OSS)
    return LLM(path, progress=False, backend="torch", max_model_len=256)


THINK = ["<|channel|>", "analysis", "<|message|>", "Let me think: 12345.", "<|end|>"]
FINAL = ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hello, world! How are you?", "<|return|>"]


def split(tok, ids, stops=(), step=None, prompt=()):
    """(reasoning, text, streamed reasoning, streamed text) of ids fed ``step`` tokens at a time (all at once if
    None) after ``prompt`` (ids)."""
    s = HarmonyStream(tok, harmony_ids(tok), stops, prompt)
    pieces = [[], []]
    step = step or len(ids) or 1
    for i in range(0, max(len(ids), 1), step):
        r, t = s.update(ids[i:i + step], finished=i + step >= len(ids))
        pieces[0].append(r)
        pieces[1].append(t)
    return s.reasoning, s.text, "".join(pieces[0]), "".join(pieces[1])


@pytest.mark.parametrize("step", [None, 1, 3])
def test_split_reasoning_and_text(oss, step):
    tok = oss.tokenizer
    ids = reply(tok, THINK + FINAL)
    assert split(tok, ids, step=step) == ("Let me think: 12345.", "Hello, world! How are you?") * 2
    # a preamble on the commentary channel is text; two analysis messages join
    more = reply(tok, THINK + ["<|start|>", "assistant", "<|channel|>", "commentary", "<|message|>", "Checking. ",
                               "<|end|>", "<|start|>", "assistant", "<|channel|>", "analysis", "<|message|>", " Done.",
                               "<|end|>"] + FINAL)
    assert split(tok, more, step=step)[:2] == ("Let me think: 12345. Done.", "Checking. Hello, world! How are you?")


@pytest.mark.parametrize("step", [None, 1])
def test_split_edge_cases(oss, step):
    tok = oss.tokenizer
    # no harmony markers at all: everything is text
    assert split(tok, tok.encode("Hello, world!", add_bos=False), step=step)[:2] == ("", "Hello, world!")
    # cut off inside the reasoning (max_tokens): what came so far, no text
    ids = reply(tok, THINK[:4])
    assert split(tok, ids, step=step)[:2] == ("Let me think: 12345.", "")
    # cut off inside the final message's header: the header is not text
    ids = reply(tok, THINK + FINAL[:4])
    assert split(tok, ids, step=step)[:2] == ("Let me think: 12345.", "")
    # a stop string cuts the message it is in (streamed: held back until it is known not to be one)
    ids = reply(tok, THINK + FINAL)
    r, t, rs, ts = split(tok, ids, stops=["How are"], step=step)
    assert (r, t, rs, ts) == ("Let me think: 12345.", "Hello, world! ", "Let me think: 12345.", "Hello, world! ")
    # ... and a stop in the reasoning drops everything after it
    r, t, _, ts = split(tok, ids, stops=["think"], step=step)
    assert (r, t, ts) == ("Let me ", "", "")
    # a message without its <|end|> before the next <|start|>, and an empty reply
    ids = reply(tok, THINK[:4] + FINAL)
    assert split(tok, ids, step=step)[:2] == ("Let me think: 12345.", "Hello, world! How are you?")
    assert split(tok, [], step=step)[:2] == ("", "")


def test_reply_ends_at_return_or_call_not_end(oss):
    tok = oss.tokenizer
    eos = set(oss.cfg.eos_ids)
    assert {tok.special_id("<|return|>"), tok.special_id("<|call|>")} <= eos
    assert tok.special_id("<|end|>") not in eos
    assert harmony_ids(tok) is not None


def test_chat_splits_the_reply(oss, monkeypatch):
    """LLM.chat on a harmony model: text is the final channel, reasoning_content the analysis; generation runs past
    <|end|> and stops at <|return|>. The sampler is scripted (a random model writes no harmony)."""
    tok = oss.tokenizer
    script = reply(tok, THINK + FINAL)
    made = script_sampler(monkeypatch, script)
    msgs = [{"role": "user", "content": "Hello"}]
    assert tok.decode(oss.chat_prompt(msgs), skip_special_tokens=False) == "<|start|>user<|message|>Hello<|end|>" \
                                                                          "<|start|>assistant"
    out = oss.chat(msgs, SamplingParams(temperature=0, max_tokens=100))[0]
    assert out.outputs[0].token_ids == script and out.finish_reason == "stop"
    assert (out.reasoning_content, out.text) == ("Let me think: 12345.", "Hello, world! How are you?")
    assert out.outputs[0].reasoning_content == out.reasoning_content
    # generate() on the same tokens keeps the raw text (markers dropped), and no reasoning_content
    made.clear()
    raw = oss.generate([oss.chat_prompt(msgs)], SamplingParams(temperature=0, max_tokens=100))[0]
    assert raw.reasoning_content is None and "Let me think" in raw.text and "Hello, world!" in raw.text


def test_split_resumes_where_the_prompt_ends(oss):
    """The prompt's last header decides where a completion begins: a generation prompt that opens the final channel
    makes the first tokens text (streamed at once), one that opens a header ("assistant") keeps that word out of
    the text of a model that writes no channel."""
    tok = oss.tokenizer
    head = reply(tok, ["<|start|>", "user", "<|message|>", "Hi", "<|end|>", "<|start|>", "assistant"])
    body = head + reply(tok, ["<|channel|>", "final", "<|message|>"])
    ids = reply(tok, ["Hello, world!", "<|return|>"])
    s = HarmonyStream(tok, harmony_ids(tok), (), body)
    assert s.update(ids[:-2], finished=False)[1] != ""  # streamed before the reply ends
    assert split(tok, ids, prompt=body)[:2] == ("", "Hello, world!")
    assert split(tok, ids, prompt=body, step=1)[2:] == ("", "Hello, world!")
    assert split(tok, ids, prompt=head)[:2] == ("", "Hello, world!")
    think = head + reply(tok, ["<|channel|>", "analysis", "<|message|>"])
    assert split(tok, ids, prompt=think)[:2] == ("Hello, world!", "")
    # a prompt whose last message is closed: the completion starts between messages
    assert split(tok, reply(tok, FINAL), prompt=head[:5])[:2] == ("", "Hello, world! How are you?")


def test_cli_generate_chat(oss, model_files, capsys, monkeypatch):
    """``generate --chat``: the prompt goes through the chat template (with --reasoning-effort as its variable); a
    harmony reply's text on stdout, its reasoning on stderr; --reasoning-effort without --chat is refused."""
    from llmkernels.__main__ import main

    _, path, _ = model_files("gpt_oss", "f32", **OSS)
    tok = oss.tokenizer
    script = reply(tok, THINK + FINAL)
    script_sampler(monkeypatch, script)
    real_generate = LLM.generate
    prompts = []

    def recording(self, ps, *a, **kw):
        prompts.extend(ps)
        return real_generate(self, ps, *a, **kw)

    monkeypatch.setattr(LLM, "generate", recording)
    assert main(["generate", path, "--prompt", "Hello", "--chat", "--reasoning-effort", "high", "--device", "cpu",
                 "--backend", "torch"]) == 0
    out = capsys.readouterr()
    assert out.out == "Hello, world! How are you?\n" and out.err.strip().splitlines()[-1] == "(reasoning) Let me think: 12345."
    msgs = [{"role": "user", "content": "Hello"}]
    assert prompts == [oss.chat_prompt(msgs, True, {"reasoning_effort": "high"})]
    assert main(["generate", path, "--prompt", "Hello", "--reasoning-effort", "high"]) == 2
    assert "needs --chat" in capsys.readouterr().err


CALL = ["<|start|>", "assistant", " to=functions.get_weather", "<|channel|>", "commentary json", "<|message|>",
        '{"city": "Paris"}', "<|call|>"]


@pytest.mark.parametrize("step", [None, 1, 4])
def test_split_tool_calls(oss, step):
    """A message with a recipient is a tool call: its name from the header, its body the arguments, streamed in
    pieces that join to them; stop strings do not cut arguments; <|call|> ends the reply."""
    tok = oss.tokenizer
    assert {tok.special_id("<|call|>")} <= set(oss.cfg.eos_ids)
    ids = reply(tok, THINK + CALL)
    s = HarmonyStream(tok, harmony_ids(tok), ("Paris",))
    args, names = {}, []
    for i in range(0, len(ids), step or len(ids)):
        s.update(ids[i:i + (step or len(ids))], finished=i + (step or len(ids)) >= len(ids))
        for k, name, piece in s.call_pieces():
            if name is not None:
                names.append(name)
            args[k] = args.get(k, "") + piece
    assert s.tool_calls == [("get_weather", '{"city": "Paris"}')] and names == ["get_weather"]
    assert args == {0: '{"city": "Paris"}'} and (s.reasoning, s.text) == ("Let me think: 12345.", "")
    # a preamble and two calls, the recipient after the channel as well
    two = reply(tok, ["<|channel|>", "commentary", "<|message|>", "Checking.", "<|end|>"] + CALL[:-1] + ["<|end|>"] +
                ["<|start|>", "assistant", "<|channel|>", "commentary to=functions.f", "<|message|>", "{}",
                 "<|call|>"])
    s = HarmonyStream(tok, harmony_ids(tok))
    s.update(two, finished=True)
    assert s.tool_calls == [("get_weather", '{"city": "Paris"}'), ("f", "{}")] and s.text == "Checking."


def test_chat_tool_calls(oss, monkeypatch):
    """LLM.chat(tools=...): the tools reach the template, the call comes back in tool_calls; an assistant message
    with tool calls whose arguments are a JSON string (as OpenAI's API sends them) renders them once, not
    re-encoded."""
    tok = oss.tokenizer
    script = reply(tok, THINK + CALL)
    script_sampler(monkeypatch, script)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather?"}]
    out = oss.chat(msgs, SamplingParams(temperature=0, max_tokens=100), tools=tools)[0]
    assert out.tool_calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}] and out.text == ""
    assert out.finish_reason == "stop" and out.outputs[0].token_ids[-1] == tok.special_id("<|call|>")
    assert "Tools: get_weather" in tok.decode(oss.chat_prompt(msgs, True, {"tools": tools}))
    turn = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "name": "get_weather", "content": "sunny"}]
    text = tok.decode(oss.chat_prompt(turn), skip_special_tokens=False)
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in text
    from llmkernels.engine.chat import ChatTemplateError

    bad = [dict(turn[1], tool_calls=[{"function": {"name": "f", "arguments": "{not json"}}])]
    with pytest.raises(ChatTemplateError, match="arguments is not JSON"):
        oss.chat_prompt(msgs + bad)
    with pytest.raises(TypeError, match="tools must be a list"):
        oss.chat(msgs, tools="get_weather")
