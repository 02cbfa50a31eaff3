"""The OpenAI-compatible API, used through the official `openai` client."""

import pytest
from openai import OpenAI

from tests.swarm import Proc, start_swarm

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    boot, addr, joins = start_swarm(tmp_path_factory.mktemp("cache"), ["0:10", "10:20", "20:30"])
    server = Proc("api", "--bootstrap", addr, "--listen", "127.0.0.1:0")
    try:
        url = server.wait_line("listening on ").removeprefix("listening on ")
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        codes = [p.stop() for p in [server] + joins + [boot]]
    assert codes[0] == 0


def test_models_lists_what_the_swarm_can_serve(api):
    models = api.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_greedy_matches_the_cli(api):
    r = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text.startswith(" Paris")
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_completion_streaming_gives_the_same_text(api):
    whole = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0).choices[0].text
    parts = [c.choices[0].text for c in api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                                               temperature=0, stream=True)]
    assert "".join(parts) == whole and len(parts) > 2


def test_streamed_text_that_looks_like_json_stays_text(api):
    # the completion starts with '{"': it must still arrive as a text chunk
    prompt = '[{"id": 1},\n{"id": 2},\n'
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    parts = [c.choices[0].text for c in api.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                               temperature=0, stream=True)]
    assert whole.startswith("{") and "".join(parts) == whole


def test_chat_completion_and_streaming(api):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    r = api.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    text = r.choices[0].message.content
    assert text and r.choices[0].message.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       api.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True))
    assert streamed == text


def test_unknown_model_and_bad_parameters_are_clear_errors(api):
    import openai

    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-3)


def test_a_request_too_long_for_every_peer_is_the_requests_error(api):
    """The peers rightly refuse a session longer than they hold: that is a 400 that
    says why, not a 503 about the swarm, and the next request is served as usual."""
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=MODEL, prompt="hi", max_tokens=8000)
    assert "holds at most" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # 200,000 characters: the numbers, not a 503
        api.completions.create(model=MODEL, prompt="hello " * 33_334, max_tokens=8)
    assert "the prompt has 33335 tokens" in str(e.value) and "holds at most 2048" in str(e.value), str(e.value)
    r = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].text.startswith(" Paris")


def test_a_bad_verify_mode_is_the_requests_error_and_the_server_serves_on(api):
    """`"verify"` (docs/verification.md) names one of three modes; anything else is a
    400 that names them, refused before any generation, and the server answers on."""
    import openai

    for bad in ["bogus", "ALWAYS", 5, ["auto"]]:
        with pytest.raises(openai.BadRequestError) as e:
            api.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"verify": bad})
        assert "verify" in str(e.value) and "'auto', 'always' or 'off'" in str(e.value), str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={"verify": "bogus"})
    assert "verify" in str(e.value), str(e.value)
    assert [m.id for m in api.models.list().data] == [MODEL]
