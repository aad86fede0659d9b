"""<think> blocks (Qwen3, DeepSeek-R1) split from the reply: the splitter over text pieces, LLM.chat and the server's
chat route on a model whose template writes them (CPU, a tiny Qwen3 with such a template, a scripted sampler)."""
import pytest

from llmkernels.engine import LLM, SamplingParams
from llmkernels.engine.reasoning import CallSplit, ThinkSplit, thinks, writes_tool_calls

THINK_TEMPLATE = ("{% if tools %}{{ 'Tools: ' + (tools | map(attribute='function') | map(attribute='name') | join(',')) "
                  "+ '. Call one as <tool_call>{...}</tool_call>\\n' }}{% endif %}"
                  "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% if open_think %}{{ '<think>\\n' }}"
                  "{% endif %}{% endif %}{# replies may start with <think> ... </think> #}")


def feed(text, inside=False, step=None):
    """(reasoning, reply, streamed reasoning, streamed reply) of text fed ``step`` characters at a time."""
    s = ThinkSplit(inside)
    pieces = [[], []]
    step = step or max(len(text), 1)
    for i in range(0, max(len(text), 1), step):
        r, t = s.feed(text[i:i + step], final=i + step >= len(text))
        pieces[0].append(r)
        pieces[1].append(t)
    return s.reasoning, s.text, "".join(pieces[0]), "".join(pieces[1])


@pytest.mark.parametrize("step", [None, 1, 3])
def test_think_split(step):
    two = ("Let me think.\nOK.", "Hello!")
    assert feed("<think>\nLet me think.\nOK.\n</think>\n\nHello!", step=step) == two * 2
    assert feed("  <think>Let me think.\nOK.</think>Hello!", step=step) == two * 2
    # opened by the prompt: only the closing tag comes
    assert feed("Let me think.\nOK.\n</think>\n\nHello!", inside=True, step=step) == two * 2
    # no block: all reply, a lone "<" included; a tag later in the text is reply text
    assert feed("Hello <think>x</think>!", step=step)[:2] == ("", "Hello <think>x</think>!")
    assert feed("<", step=step)[:2] == ("", "<")
    # cut off inside the block (max_tokens): what came is reasoning, no reply; an empty block
    assert feed("<think>\nLet me", step=step)[:2] == ("Let me", "")
    assert feed("<think>\n\n</think>\n\nHi", step=step)[:2] == ("", "Hi")
    assert feed("", step=step)[:2] == ("", "")


def test_think_template_detection():
    assert thinks(THINK_TEMPLATE) and not thinks("{{ messages }}") and not thinks(None)
    assert writes_tool_calls(THINK_TEMPLATE) and not writes_tool_calls("{{ messages }}")


@pytest.mark.parametrize("step", [None, 1, 5])
def test_call_split(step):
    """<tool_call> blocks out of the text as (name, arguments JSON); text around them kept; a block that is no call
    stays text; a block cut off unclosed is read if its JSON is whole."""
    def run(text):
        s = CallSplit()
        n = step or max(len(text), 1)
        streamed = "".join(s.feed(text[i:i + n], final=i + n >= len(text)) for i in range(0, max(len(text), 1), n))
        assert streamed == s.text
        return s.text, s.tool_calls

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert run("Let me check.\n" + call) == ("Let me check.", [("get_weather", '{"city": "Paris"}')])
    assert run(call + "\n" + call.replace("Paris", "Oslo")) == ("", [("get_weather", '{"city": "Paris"}'),
                                                                    ("get_weather", '{"city": "Oslo"}')])
    assert run("<tool_call>not json</tool_call> ok") == ("<tool_call>not json</tool_call> ok", [])
    assert run(call[:-len("</tool_call>")]) == ("", [("get_weather", '{"city": "Paris"}')])
    assert run("a < b <tool") == ("a < b <tool", [])


@pytest.fixture(scope="module")
def qwen3(model_files):
    _, path, _ = model_files("qwen3", "f32")
    return LLM(path, progress=False, backend="torch", max_model_len=256, chat_template=THINK_TEMPLATE)


def test_chat_and_server_split_think(qwen3, monkeypatch):
    """LLM.chat: the block's text in reasoning_content, the rest in text (also when the template opened the block);
    the server answers the same, streamed as reasoning_content and content deltas."""
    from tests.harmony_script import script_sampler

    openai = pytest.importorskip("openai")
    from tests.server.test_server import MODEL, live_server

    tok = qwen3.tokenizer
    assert qwen3.thinking and qwen3.harmony is None
    eos = [qwen3.cfg.eos_ids[0]]
    full = tok.encode("<think>\nThe user greets.\n</think>\n\nHello, world!", add_bos=False) + eos
    script_sampler(monkeypatch, full)
    msgs = [{"role": "user", "content": "Hi"}]
    out = qwen3.chat(msgs, SamplingParams(temperature=0, max_tokens=100))[0]
    assert (out.reasoning_content, out.text) == ("The user greets.", "Hello, world!")
    script_sampler(monkeypatch, tok.encode("The user greets.\n</think>\n\nHello, world!", add_bos=False) + eos)
    out = qwen3.chat(msgs, SamplingParams(temperature=0, max_tokens=100), chat_template_kwargs={"open_think": True})[0]
    assert (out.reasoning_content, out.text) == ("The user greets.", "Hello, world!")
    script_sampler(monkeypatch, full)
    with live_server(qwen3) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100)
        m = r.choices[0].message
        assert (m.model_extra["reasoning_content"], m.content) == ("The user greets.", "Hello, world!")
        chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(d.content or "" for d in deltas) == "Hello, world!"
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "The user greets."


def test_chat_and_server_tag_tool_calls(qwen3, monkeypatch):
    """A template that writes <tool_call> blocks: tools go to the template, the block comes back as a tool call
    (LLM.chat: tool_calls; server: message.tool_calls with finish_reason "tool_calls", streamed whole), the think
    block as reasoning."""
    from tests.harmony_script import script_sampler

    openai = pytest.importorskip("openai")
    from tests.server.test_server import MODEL, live_server

    tok = qwen3.tokenizer
    assert qwen3.tool_calls_as == "tags"
    text = '<think>\nWeather needed.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' \
           '\n</tool_call>'
    script_sampler(monkeypatch, tok.encode(text, add_bos=False) + [qwen3.cfg.eos_ids[0]])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    out = qwen3.chat(msgs, SamplingParams(temperature=0, max_tokens=150), tools=tools)[0]
    assert out.tool_calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert (out.reasoning_content, out.text) == ("Weather needed.", "")
    with live_server(qwen3) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=150)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        call = ch.message.tool_calls[0]
        assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
        assert r.usage.prompt_tokens == len(qwen3.chat_prompt(msgs, True, {"tools": tools}))
        chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=150,
                                                stream=True))
        parts = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [(p.index, p.function.name, p.function.arguments) for p in parts] == [
            (0, "get_weather", '{"city": "Paris"}')]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
