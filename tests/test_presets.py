"""Presets: Ollama's Modelfile read and written back, Go templates rendered as Ollama renders them,
presets in the store (nothing copied, bases kept), and presets applied when they run."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from localrun import api, settings
from localrun.chat import parse_messages, render_template
from localrun.errors import LocalrunError, UsageError
from localrun.generation import Request
from localrun.presets import Preset, go_template, read_modelfile
from localrun.settings import GenerationParams

HERE = Path(__file__).parent / "ollama_templates"
MODEL = "smollm2:135m"

PIRATE = '''# a Modelfile as Ollama's users write them
FROM smollm2:135m
parameter temperature 0
PARAMETER num_predict 6
PARAMETER stop "<|im_end|>"
PARAMETER stop User:
PARAMETER num_ctx 1024
SYSTEM """You are a pirate.
Answer "briefly"."""
MESSAGE user Who are you?
MESSAGE assistant Arr, a pirate.
LICENSE MIT
TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
'''


def test_a_modelfile_reads_as_ollama_reads_it() -> None:
    p = read_modelfile(PIRATE)
    assert p.base == MODEL
    assert p.parameters == {"temperature": 0.0, "num_predict": 6, "stop": ["<|im_end|>", "User:"], "num_ctx": 1024}
    assert p.system == 'You are a pirate.\nAnswer "briefly".'
    assert p.messages == ({"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Arr, a pirate."})
    assert p.license == ("MIT",)
    assert p.template_source is not None and p.template and "for item1 in" in p.template
    assert p.generation_values() == {"temperature": 0.0, "max_tokens": 6, "stop": ("<|im_end|>", "User:")}
    assert p.load_values() == {"n_ctx": 1024}
    # written back, it reads as the same preset
    assert read_modelfile(p.modelfile("header")) == p


@pytest.mark.parametrize(("text", "message"), [
    ("PARAMETER temperature 0.1\n", "no FROM line"),
    ("FROM m\nPARAMETR top_k 5\n", "line 2: unknown instruction 'PARAMETR'"),
    ("FROM m\n\nPARAMETER top_k x\n", "line 3: bad value 'x' for parameter 'top_k'"),
    ("FROM m\nPARAMETER top_k -1\n", "line 2: bad value '-1' for parameter 'top_k'"),
    ("FROM m\nPARAMETER mirostat 1\n", "line 2: parameter 'mirostat' is not supported"),
    ("FROM m\nPARAMETER colour blue\n", "line 2: unknown parameter 'colour'"),
    ("FROM m\nPARAMETER kv_cache_type q3\n", "line 2: bad value 'q3' for parameter 'kv_cache_type'"),
    ("FROM m\nMESSAGE robot hi\n", "line 2: message role 'robot'"),
    ('FROM m\nSYSTEM """never closed\n\n', 'line 2: a value opened with """ is never closed'),
    ("FROM m\nFROM n\n", "line 2: a second FROM line"),
    ("FROM m\nSYSTEM\n", "line 2: 'SYSTEM' is not an instruction"),
    ("FROM m\nTEMPLATE {{ .Prompt | upper }}\n", "line 2: the TEMPLATE's {{ .Prompt | upper }} cannot be translated"),
    ("FROM m\n# ok\nTEMPLATE {{ template \"x\" }}\n", "line 3: the TEMPLATE's {{ template \"x\" }} cannot be translated"),
    ("FROM m\nTEMPLATE {{ if .System }}open\n", "has a block without its {{ end }}"),
    ("FROM m\nTEMPLATE \"{% if x %}\"\n", "line 2: the TEMPLATE is not a valid Jinja template"),
])
def test_a_bad_modelfile_names_its_line(text: str, message: str) -> None:
    with pytest.raises(UsageError) as e:
        read_modelfile(text)
    assert message in e.value.message


def _go_cases() -> tuple[dict[str, object], dict[str, list[str]]]:
    cases = json.loads((HERE / "cases.json").read_text())
    return cases, json.loads((HERE / "expected.json").read_text())


def test_go_templates_render_as_go_renders_them() -> None:
    """expected.json is Go's text/template output under Ollama's rules (tests/ollama_templates/render.go):
    templates over .Messages, older ones per turn cut after .Response, variables, printf, break,
    continue, trim markers; each conversation renders the same, byte for byte."""
    cases, expected = _go_cases()
    templates = cases["templates"]
    assert isinstance(templates, dict) and len(templates) == 7
    for name, text in templates.items():
        jinja = go_template(text)
        for i, conversation in enumerate(cases["conversations"]):  # type: ignore[arg-type]
            assert render_template(jinja, parse_messages(conversation)) == expected[name][i], (name, i)
    go = shutil.which("go")
    if go:  # the record is still what Go gives
        out = subprocess.run([go, "run", "render.go"], cwd=HERE, input=(HERE / "cases.json").read_text(),
                             capture_output=True, text=True, timeout=300, check=True)
        assert json.loads(out.stdout) == expected


def test_a_go_template_reads_tools_as_ollama_passes_them() -> None:
    jinja = go_template('{{ range .Tools }}{{ .Function.Name }}({{ range $k, $v := .Function.Parameters.Properties }}'
                        '{{ $k }}: {{ $v.Type }}, {{ end }}){{ end }}|{{ json (index .Tools 0).Function.Name }}')
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string"}, "city": {"type": "string"}}}}}]
    assert render_template(jinja, parse_messages([{"role": "user", "content": "x"}]), tools=tools) == \
        'weather(city: string, unit: string, )|"weather"'


def _create(tmp_path: Path, name: str, text: str) -> object:
    (tmp_path / "Modelfile").write_text(text)
    return api.create_preset(name, text, base_dir=tmp_path)


def test_a_preset_is_an_entry_on_its_base(tmp_path: Path, isolated_home: Path, cli: object, starter: Path) -> None:
    made = _create(tmp_path, "pirate", PIRATE)
    assert made.name == "pirate:latest" and made.is_preset and made.base == MODEL  # type: ignore[attr-defined]
    stored = sum(p.stat().st_size for p in isolated_home.rglob("*") if p.is_file())
    assert stored < 1 << 20  # nothing of the model is copied
    # a preset of a preset: the nearer settings win, the rest come from below
    child = _create(tmp_path, "calm", "FROM pirate\nPARAMETER num_predict 3\nSYSTEM Be calm.\n")
    target = api.resolve_target(child.name)  # type: ignore[attr-defined]
    assert target.model.name == MODEL and target.name == "calm:latest"
    assert target.preset is not None
    assert target.preset.generation_values() == {"temperature": 0.0, "max_tokens": 3, "stop": ("<|im_end|>", "User:")}
    resolved = settings.resolve({"max_tokens": 9}, target)  # the request's own over the presets'
    assert (resolved.temperature, resolved.max_tokens, resolved.stop) == (0.0, 9, ("<|im_end|>", "User:"))
    # a FROM chain may not loop
    with pytest.raises(UsageError, match="its own base"):
        api.create_preset("pirate", "FROM calm\n")
    # list shows presets; rm of a base in use names its presets; show --modelfile creates the same preset
    listed = cli("list", "--json")  # type: ignore[operator]
    entries = {m["name"]: m for m in json.loads(listed.stdout)}
    assert entries["pirate:latest"]["kind"] == "preset" and entries["pirate:latest"]["base"] == MODEL
    refused = cli("rm", MODEL)  # type: ignore[operator]
    assert refused.returncode != 0 and "base of the preset pirate:latest" in refused.stderr
    refused = cli("rm", "pirate")  # type: ignore[operator]
    assert refused.returncode != 0 and "base of the preset calm:latest" in refused.stderr
    written = cli("show", "pirate", "--modelfile")  # type: ignore[operator]
    assert written.returncode == 0, written.stderr
    (tmp_path / "Again").write_text(written.stdout)
    again = cli("create", "pirate2", "-f", str(tmp_path / "Again"))  # type: ignore[operator]
    assert again.returncode == 0, again.stderr
    st = api.store()
    assert st.get("pirate2").details["preset"] == st.get("pirate").details["preset"]
    shown = cli("show", "pirate")  # type: ignore[operator]
    assert "context         1024" in shown.stdout and "preset" in shown.stdout
    # cp: another name, the same settings; removing the presets frees the base
    copied = cli("cp", "calm", "calm-copy")  # type: ignore[operator]
    assert copied.returncode == 0 and st.get("calm-copy").details["preset"] == st.get("calm").details["preset"]
    assert cli("rm", "calm", "calm-copy", "pirate2", "pirate").returncode == 0  # type: ignore[operator]
    assert MODEL in st.names()


def test_a_preset_runs_with_its_settings_under_the_request_options(tmp_path: Path, cli: object, starter: Path) -> None:
    _create(tmp_path, "pirate", PIRATE)
    out = cli("run", "pirate", "Who is the captain?", "--json", "--verbose")  # type: ignore[operator]
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["model"] == "pirate:latest" and record["completion_tokens"] <= 6
    assert "context 1024" in out.stderr  # the preset's num_ctx
    # the same conversation sent by hand to the base, greedy, gives the same reply
    messages = [{"role": "system", "content": 'You are a pirate.\nAnswer "briefly".'},
                {"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Arr, a pirate."},
                {"role": "user", "content": "Who is the captain?"}]
    target = api.resolve_target("pirate")
    session = api.load(MODEL)
    try:
        by_hand = Request(messages=tuple(parse_messages(messages)), template=target.preset.template)  # type: ignore[union-attr]
        chunks = list(api.stream(session, by_hand, GenerationParams(temperature=0, max_tokens=6,
                                                                       stop=("<|im_end|>", "User:"))))
        assert "".join(c.text for c in chunks) == record["text"]
        assert chunks[-1].prompt_tokens == record["prompt_tokens"]
    finally:
        session.close()
    # a request's own options go over the preset's
    longer = cli("run", "pirate", "Who is the captain?", "--json", "--max-tokens", "9", "--stop", "zzz")  # type: ignore[operator]
    assert json.loads(longer.stdout)["completion_tokens"] == 9


def test_a_preset_of_a_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LocalrunError, match="is not installed"):
        api.create_preset("ghost", "FROM nothing-here:7b\n")
    assert Preset.from_dict(Preset("x", {"stop": ["a"]}).to_dict()) == Preset("x", {"stop": ["a"]})


def test_from_a_hugging_face_folder_converts_it_once(tmp_path: Path, thinker: object) -> None:
    gguf = thinker()  # type: ignore[operator]
    checkpoint = Path(gguf).with_suffix("")  # the Hugging Face folder kept beside the GGUF
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    first = api.create_preset("tiny-a", "FROM ./ckpt\nPARAMETER temperature 0.3\n", base_dir=tmp_path)
    converted = api.store().converted_from(folder)
    assert len(converted) == 1 and first.base == converted[0]  # type: ignore[attr-defined]
    second = api.create_preset("tiny-b", "FROM ./ckpt\nSYSTEM hello\n", base_dir=tmp_path)
    assert second.base == first.base and api.store().converted_from(folder) == converted  # type: ignore[attr-defined]


def test_batch_runs_a_preset_with_its_settings(tmp_path: Path, cli: object, starter: Path) -> None:
    _create(tmp_path, "pirate", PIRATE)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": 1, "prompt": "Who is the captain?"}) + "\n"
                    + json.dumps({"id": 2, "prompt": "Who is the captain?", "max_tokens": 2}) + "\n")
    out = tmp_path / "out.jsonl"
    done = cli("batch", "pirate", "-i", str(rows), "-o", str(out))  # type: ignore[operator]
    assert done.returncode == 0, done.stderr
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    # the preset's system prompt, starting conversation, template, num_predict and greedy temperature
    single = json.loads(cli("run", "pirate", "Who is the captain?", "--json").stdout)  # type: ignore[operator]
    assert records[1]["prompt_tokens"] == single["prompt_tokens"]
    assert records[1]["completion_tokens"] <= 6
    assert records[2]["completion_tokens"] <= 2  # a row's own setting over the preset's
