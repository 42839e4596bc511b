"""Rerankers of both families people use, built with transformers from their published configs
(narrowed) and converted by localrun: a tiny Qwen3-Reranker with the real Qwen3 tokenizer, scored
as the model card's own code scores it, and a tiny BGE reranker (XLM-RoBERTa with a
classification head, on a SentencePiece Unigram vocabulary trained here), scored as transformers'
cross-encoder; each file is the one llama.cpp's converter writes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from convert_helpers import (
    gguf_reader,
    gguf_tensors,
    make_checkpoint,
    model_keys,
    need_asset,
    reference_gguf,
)

import convert

# Qwen/Qwen3-Reranker-0.6B's config.json keys that differ from the tiny Qwen3's (its widths and
# depth stay narrowed): tied embeddings, whose "yes" and "no" rows are the reranker's head.
PUBLISHED = {"tie_word_embeddings": True, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
             "rms_norm_eps": 1e-06}
QUERY = "What is the capital of France?"
DOCS = [
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower was finished in 1889.",
    "Bananas are rich in potassium.",
    "Berlin is the capital of Germany.",
    "France borders Spain, Italy and Germany.",
]
# The model card's prompt (Qwen3-Reranker's README), written here from the card, not from the file.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"


# BAAI/bge-reranker-v2-m3's config.json, narrowed (depth, widths; its vocabulary is trained here).
BGE = {"architectures": ["XLMRobertaForSequenceClassification"], "hidden_act": "gelu", "layer_norm_eps": 1e-05,
       "max_position_embeddings": 8194, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
       "type_vocab_size": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
       "position_embedding_type": "absolute", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4}
INIT = 0.1


def make_bge_reranker(folder: Path, init: float = INIT):  # noqa: ANN201
    """A tiny BGE reranker: XLMRobertaForSequenceClassification with an XLM-R tokenizer made from a
    SentencePiece Unigram model trained on the real chat templates among the test assets and the
    test's own sentences (the real one ships its
    sentencepiece.bpe.model and the tokenizer.json transformers makes of it)."""
    import json

    import sentencepiece as spm
    import torch
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    templates = sorted(need_asset("chat-templates").glob("*.jinja"))
    lines = [line for path in templates for line in path.read_text(encoding="utf-8").splitlines()] + [QUERY, *DOCS]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(folder / "sp"), vocab_size=500,
                                   model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
                                   minloglevel=2, num_threads=1)
    (folder / "sp.model").rename(folder / "sentencepiece.bpe.model")
    (folder / "sp.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "XLMRobertaTokenizer",
                                                              "model_max_length": 8192}))
    tok = tf.AutoTokenizer.from_pretrained(folder)
    tok.save_pretrained(folder)
    # A wide initialisation (and random norms and biases, so that a dropped one shows): at the
    # published 0.02 every document scores the same to 1e-4 and there is no order to check; from
    # 0.12 up, llama.cpp's GELU (tanh's, from a float16 table on CPU, for transformers' erf) moves
    # the scores by about 1e-3.
    config = tf.XLMRobertaConfig(**{**BGE, "vocab_size": len(tok), "initializer_range": init})
    torch.manual_seed(0)
    model = tf.XLMRobertaForSequenceClassification(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(1 + (torch.rand(p.shape, generator=g) - 0.5) * 0.4)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(folder)
    return model, tok


@pytest.fixture(scope="module")
def bge(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("bge") / "bge-reranker-tiny"
    model, tok = make_bge_reranker(folder)
    return folder, model, tok


def assert_ranks(path: Path, want: list[float], gap: float) -> Any:
    """localrun's scores of the documents on a converted file: within 1e-3 of the reference's (in
    F32), in the same order, which `gap` between the reference's scores makes worth checking."""
    from localrun import api
    from localrun.settings import LoadOptions

    assert min(abs(a - b) for i, a in enumerate(want) for b in want[i + 1:]) > gap  # an order to check
    session = api.load(str(path), LoadOptions(n_ctx=512))
    try:
        got = session.rerank(QUERY, DOCS)
    finally:
        session.close()
    assert np.allclose(got.scores, want, atol=1e-3), (got.scores, want)
    assert np.argsort(got.scores).tolist() == np.argsort(want).tolist()
    return got


def cross_encoder_scores(model, tok) -> list[float]:  # noqa: ANN001
    """transformers' cross-encoder score of each pair: the classification head's logit."""
    import torch

    with torch.no_grad():
        return [float(model(**tok(QUERY, doc, return_tensors="pt")).logits[0, 0]) for doc in DOCS]


def test_bge_reranker_scores_equal_transformers(bge, tmp_path: Path) -> None:  # noqa: ANN001

    folder, model, tok = bge
    path = convert.convert(folder, tmp_path / "b.gguf", outtype="f32").path
    keys = model_keys(gguf_reader(path))
    assert keys["bert.pooling_type"] == 4 and keys["bert.classifier.output_labels"] == ["LABEL_0"]
    want = cross_encoder_scores(model, tok)
    got = assert_ranks(path, want, gap=2e-3)  # an order 1e-3 cannot flip
    # <s> query </s></s> document </s>: the pair as the tokenizer writes it
    assert got.prompt_tokens == sum(len(tok(QUERY, d)["input_ids"]) for d in DOCS)


@pytest.mark.slow
def test_bge_reranker_file_is_llama_cpps(bge, llama_cpp_converter: Path, tmp_path: Path) -> None:  # noqa: ANN001
    """The same tensors and keys, and one key more: the file says it is a reranker (llama.cpp's
    converter leaves that to llama-server's --rerank), and a file without it still ranks."""
    from localrun import api
    from localrun.settings import LoadOptions

    ref_path = tmp_path / "ref.gguf"
    ref = reference_gguf(llama_cpp_converter, bge[0], ref_path, "f16")
    ours = gguf_reader(convert.convert(bge[0], tmp_path / "ours.gguf", outtype="f16").path)
    assert gguf_tensors(ours) == gguf_tensors(ref)
    want, got = model_keys(ref), model_keys(ours)
    assert {k: v for k, v in got.items() if k != "bert.pooling_type"} == want and got["bert.pooling_type"] == 4
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.precompiled_charsmap", "tokenizer.ggml.add_space_prefix"):
        assert ours.fields[key].contents() == ref.fields[key].contents(), key
    session = api.load(str(ref_path), LoadOptions(n_ctx=512))
    try:
        scores = session.rerank(QUERY, DOCS).scores
    finally:
        session.close()
    assert np.allclose(scores, cross_encoder_scores(*bge[1:]), atol=1e-2)  # F16 weights
    assert api.capabilities(api.get_model(str(ref_path))) == ("rerank",)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("rerank") / "Qwen3-Reranker-tiny"
    folder.mkdir()
    model, tok = make_checkpoint(folder, "qwen3", config=PUBLISHED, seed=3)
    return folder, model, tok


def card_scores(model, tok) -> list[float]:  # noqa: ANN001
    """The model card's scoring: the last position's "yes" against "no", softmaxed."""
    import torch

    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    out = []
    for doc in DOCS:
        text = f"{PREFIX}<Instruct>: {INSTRUCT}\n<Query>: {QUERY}\n<Document>: {doc}{SUFFIX}"
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1, [yes, no]].double()
        out.append(float(torch.softmax(logits, dim=0)[0]))
    return out


def test_qwen3_reranker_scores_equal_transformers(reranker, tmp_path: Path) -> None:  # noqa: ANN001

    folder, model, tok = reranker
    path = convert.convert(folder, tmp_path / "r.gguf", outtype="f32").path
    keys = model_keys(gguf_reader(path))
    assert keys["qwen3.pooling_type"] == 4 and keys["qwen3.classifier.output_labels"] == ["yes", "no"]
    want = card_scores(model, tok)
    got = assert_ranks(path, want, gap=5e-3)
    assert got.prompt_tokens == sum(len(tok(f"{PREFIX}<Instruct>: {INSTRUCT}\n<Query>: {QUERY}\n<Document>: "
                                            f"{d}{SUFFIX}", add_special_tokens=False)["input_ids"]) for d in DOCS)


@pytest.mark.slow
def test_qwen3_reranker_file_is_llama_cpps(reranker, llama_cpp_converter: Path, tmp_path: Path) -> None:  # noqa: ANN001
    folder = tmp_path / "Qwen3-Reranker-tiny"
    shutil.copytree(reranker[0], folder)
    ref = reference_gguf(llama_cpp_converter, folder, tmp_path / "ref.gguf", "f16")
    ours = gguf_reader(convert.convert(folder, tmp_path / "ours.gguf", outtype="f16").path)
    assert gguf_tensors(ours) == gguf_tensors(ref)
    want, got = model_keys(ref), model_keys(ours)
    assert got == want
    rf, of = ref.fields, ours.fields
    assert of["tokenizer.chat_template.rerank"].contents() == rf["tokenizer.chat_template.rerank"].contents()


def test_a_plain_qwen3_is_no_reranker(tmp_path: Path, reranker) -> None:  # noqa: ANN001
    folder = tmp_path / "tiny-qwen3"
    shutil.copytree(reranker[0], folder)
    keys = model_keys(gguf_reader(convert.convert(folder, tmp_path / "m.gguf", outtype="f16").path))
    assert "qwen3.pooling_type" not in keys


@pytest.fixture(scope="module")
def reranker_gguf(reranker, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: ANN001
    return convert.convert(reranker[0], tmp_path_factory.mktemp("rerank-f32") / "r.gguf", outtype="f32").path


def test_rerank_endpoint_in_jina_cohere_and_tei_shapes(reranker, reranker_gguf: Path) -> None:  # noqa: ANN001
    from localrun import api
    from localrun.settings import LoadOptions
    from tests.server.conftest import serve

    want = card_scores(*reranker[1:])
    best = sorted(range(len(DOCS)), key=lambda i: -want[i])
    api.add_model(str(reranker_gguf), "tiny-reranker:f32")
    with serve(LoadOptions(n_ctx=512)) as served:
        http = served.http()
        res = http.post("/v1/rerank", json={"model": "tiny-reranker:f32", "query": QUERY, "documents": DOCS,
                                            "top_n": 3, "return_documents": True})
        assert res.status_code == 200, res.text
        body = res.json()
        assert [r["index"] for r in body["results"]] == best[:3]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([want[i] for i in best[:3]], abs=1e-3)
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in best[:3]]
        assert body["usage"]["prompt_tokens"] > 0 and body["object"] == "list"
        # Cohere's documents as objects; llama-server's other routes
        objects = http.post("/rerank", json={"model": "tiny-reranker:f32", "query": QUERY,
                                             "documents": [{"text": d} for d in DOCS]}).json()
        assert [r["index"] for r in objects["results"]] == best and "document" not in objects["results"][0]
        tei = http.post("/v1/reranking", json={"model": "tiny-reranker:f32", "query": QUERY, "texts": DOCS,
                                               "return_text": True}).json()
        assert [r["index"] for r in tei] == best and tei[0]["text"] == DOCS[best[0]] and "score" in tei[0]
        # a model that is not a reranker, no documents, an unknown model: 400, 400, 404
        res = http.post("/v1/rerank", json={"model": "smollm2:135m", "query": QUERY, "documents": DOCS})
        assert res.status_code == 400 and "is not a reranker" in res.text
        assert http.post("/v1/rerank", json={"model": "tiny-reranker:f32", "query": QUERY,
                                             "documents": []}).status_code == 400
        assert http.post("/v1/rerank", json={"model": "nope", "query": QUERY, "documents": DOCS}).status_code == 404
        # its embeddings are refused by name, and /api/show says what it does
        res = http.post("/v1/embeddings", json={"model": "tiny-reranker:f32", "input": "x"})
        assert res.status_code == 400 and "is a reranker" in res.text
        show = http.post("/api/show", json={"model": "tiny-reranker:f32"}).json()
        assert show["capabilities"] == ["rerank"]


def test_rerank_command(reranker, reranker_gguf: Path, tmp_path: Path) -> None:  # noqa: ANN001
    import json
    import subprocess
    import sys

    want = card_scores(*reranker[1:])
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join([DOCS[0], json.dumps({"text": DOCS[1]}), json.dumps(DOCS[2]), "", *DOCS[3:]]) + "\n")
    out = subprocess.run([sys.executable, "-m", "localrun", "rerank", str(reranker_gguf), QUERY, "--docs", str(docs),
                          "--json", "--top-n", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)["results"]
    best = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in results] == best and [r["document"] for r in results] == [DOCS[i] for i in best]
    table = subprocess.run([sys.executable, "-m", "localrun", "rerank", str(reranker_gguf), QUERY, "-d", str(docs)],
                           capture_output=True, text=True, timeout=300)
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[1] == str(best[0])
