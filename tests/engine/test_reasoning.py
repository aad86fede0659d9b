"""<think> blocks (Qwen3, DeepSeek-R1) split from the reply: the splitter over text pieces, LLM.chat and the server's
chat route on a model whose template writes them (CPU, a tiny Qwen3 with such a template, a scripted sampler)."""
import pytest

from llmkernels.engine import LLM, SamplingParams
from llmkernels.engine.reasoning import ThinkSplit, thinks

THINK_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
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
