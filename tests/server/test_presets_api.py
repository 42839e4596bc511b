"""Presets through the server, as the official clients make and use them: ollama-python's create
(from + system + parameters), an older client's Modelfile text, show, copy, delete, and chats
through both APIs that run with the preset's settings under the request's own options."""

from __future__ import annotations

import pytest

from localrun import api

from .conftest import MODEL, Served


def test_create_show_copy_and_chat_through_ollama_python(served: Served) -> None:
    client = served.ollama()
    done = client.create(model="brief", from_=MODEL, system="Answer in one word.",
                         parameters={"temperature": 0, "num_predict": 3, "stop": ["\n\n", "User:"]})
    assert done.status == "success"
    info = client.show("brief")
    assert served.http().post("/api/show", json={"model": "brief"}).json()["system"] == "Answer in one word."
    assert "num_predict" in (info.parameters or "") and '"User:"' in (info.parameters or "")
    assert "SYSTEM Answer in one word." in (info.modelfile or "")
    assert "PARAMETER stop User:" in (info.modelfile or "")
    assert info.details.parent_model == MODEL
    names = [m.model for m in client.list().models]
    assert "brief" in names or "brief:latest" in names

    question = [{"role": "user", "content": "What colour is the sky?"}]
    out = client.chat(model="brief", messages=question)
    assert out.eval_count == 3  # the preset's num_predict
    again = client.chat(model="brief", messages=question, options={"num_predict": 5})
    assert again.eval_count == 5  # the request's own option over the preset's
    # the preset's system prompt reaches the model: the same chat sent to the base with it, greedy
    by_hand = client.chat(model=MODEL, messages=[{"role": "system", "content": "Answer in one word."}, *question],
                          options={"temperature": 0, "num_predict": 3, "stop": ["\n\n", "User:"]})
    assert out.message.content == by_hand.message.content
    assert out.prompt_eval_count == by_hand.prompt_eval_count

    assert client.copy("brief", "brief-copy").status == "success"
    assert "SYSTEM Answer in one word." in (client.show("brief-copy").modelfile or "")
    # the base of presets is not deleted from under them
    import ollama

    with pytest.raises(ollama.ResponseError) as e:
        client.delete(MODEL)
    assert "base of the presets brief-copy:latest, brief:latest" in str(e.value)
    client.delete("brief-copy")
    client.delete("brief")
    assert MODEL in [m.model for m in client.list().models]


def test_a_modelfile_over_http_and_a_preset_through_openai(served: Served) -> None:
    http = served.http()
    modelfile = "FROM smollm2:135m\nPARAMETER temperature 0\nPARAMETER num_predict 4\nSYSTEM You are terse.\n"
    r = http.post("/api/create", json={"model": "terse", "modelfile": modelfile, "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}
    bad = http.post("/api/create", json={"model": "bad", "modelfile": "FROM smollm2:135m\nPARAMETER top_k x\n"})
    assert bad.status_code == 400 and "line 2: bad value 'x' for parameter 'top_k'" in bad.json()["error"]
    missing = http.post("/api/create", json={"model": "bad", "from": "no-such-model:1b"})
    assert missing.status_code == 404

    oa = served.openai()
    reply = oa.chat.completions.create(model="terse", messages=[{"role": "user", "content": "Name a fruit."}])
    assert reply.usage.completion_tokens == 4  # the preset's num_predict through the OpenAI API
    base = oa.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}])
    assert reply.choices[0].message.content == base.choices[0].message.content
    assert api.get_model("terse").is_preset

    # /api/generate with the request's own Go template renders as the same prompt sent raw
    options = {"temperature": 0, "num_predict": 5}
    templated = served.ollama().generate(model=MODEL, prompt="Hi", template="Q: {{ .Prompt }}\nA:{{ .Response }}",
                                         options=options)
    raw = served.ollama().generate(model=MODEL, prompt="Q: Hi\nA:", raw=True, options=options)
    assert (templated.response, templated.prompt_eval_count) == (raw.response, raw.prompt_eval_count)
