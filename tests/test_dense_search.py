"""The dense retriever (MiniLM, plain transformers) and Search-R1's data files."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrl.envs.utils import check_env_specs

from torchrl_agent.collectors.step_collector import _per_task_success
from torchrl_agent.envs import make_env
from torchrl_agent.envs.search import (
    Corpus,
    DenseRetriever,
    SearchEnv,
    default_dense_model_path,
    load_fanoutqa_questions,
    load_searchr1_questions,
    load_wiki_corpus,
)

TITLES = ["Ulaanbaatar", "Mongolia", "Wright brothers", "Airplane", "Eiffel Tower", "Gustave Eiffel",
          "Mount Everest", "Photosynthesis", "Volcano", "Jazz", "Chess", "Penicillin"]


@pytest.fixture(scope="module")
def small_corpus():
    by_title = {p.title: p for p in load_wiki_corpus("en-us").passages}
    return Corpus.from_passages([by_title[t] for t in TITLES], name="dense-test")


@pytest.fixture(scope="module")
def dense(small_corpus, tmp_path_factory):
    return DenseRetriever(small_corpus, cache_dir=tmp_path_factory.mktemp("cache"))


def test_retrieves_the_right_passage(dense):
    queries = ["What is the capital city of Mongolia?", "Who built the first powered aircraft?",
               "Which antibiotic did Alexander Fleming discover?", "How do plants turn light into sugar?"]
    top = [[p.title for p in hits] for hits in dense.search(queries, 3)]
    assert top[0][0] in ("Ulaanbaatar", "Mongolia") and {"Ulaanbaatar", "Mongolia"} <= set(top[0][:3])
    assert top[1][0] in ("Wright brothers", "Airplane")
    assert top[2][0] == "Penicillin" and top[3][0] == "Photosynthesis"
    scores = [p.score for p in dense.search(queries[:1], 12)[0]]
    assert scores == sorted(scores, reverse=True) and len(scores) == len(TITLES)


def test_embeddings_are_mean_pooled_normalised_and_padding_free(dense, small_corpus):
    assert dense.model_path == default_dense_model_path() and dense.pooling == "mean" and dense.normalize
    assert dense.embeddings.shape == (len(small_corpus), 384) and dense.embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(dense.embeddings, axis=1), 1.0, atol=1e-5)
    texts = ["short", "a much longer sentence that forces padding onto the short one in the batch"]
    together = dense.encode(texts)
    alone = np.concatenate([dense.encode(texts[:1]), dense.encode(texts[1:])])
    np.testing.assert_allclose(together, alone, atol=1e-5)  # the attention mask keeps pads out of the mean
    # the same pooling by hand from the model's token states
    batch = dense.tokenizer(texts[:1], return_tensors="pt")
    with torch.no_grad():
        hidden = dense.model(**batch).last_hidden_state[0]
    manual = torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy()
    np.testing.assert_allclose(together[0], manual, atol=1e-5)


def test_embeddings_are_cached(dense, small_corpus):
    assert not dense.loaded_from_cache and dense.embeddings_path.is_file()
    again = DenseRetriever(small_corpus, cache_dir=dense.embeddings_path.parents[1])
    assert again.loaded_from_cache and np.array_equal(again.embeddings, dense.embeddings)
    dense.embeddings_path.write_bytes(b"not an array")  # a corrupt cache entry is rebuilt
    rebuilt = DenseRetriever(small_corpus, cache_dir=dense.embeddings_path.parents[1])
    assert not rebuilt.loaded_from_cache
    np.testing.assert_allclose(rebuilt.embeddings, dense.embeddings, atol=1e-6)
    other = DenseRetriever(small_corpus, cache_dir=dense.embeddings_path.parents[1], query_prefix="query: ",
                           passage_prefix="passage: ")
    assert other.embeddings_path != dense.embeddings_path  # prefixes change the passage embeddings
    with pytest.raises(FileNotFoundError, match="model_path"):
        DenseRetriever(small_corpus, model_path=dense.embeddings_path.parent)


def test_search_env_with_dense_retriever(dense):
    question = next(q for q in load_fanoutqa_questions() if q.question == "What is the capital of Mongolia?")
    env = make_env("search", num_groups=1, group_size=2, retriever=dense, questions=[question])
    check_env_specs(env)
    td = env.reset()
    td["action"] = ["<search>capital of Mongolia</search>", "<answer>Ulaanbaatar</answer>"]
    out = env.step(td)["next"]
    assert out["observation"][0].startswith("<information>Doc 1(Title: ") and out["observation"][0].count("(Title: ") == 3
    assert "Ulaanbaatar" in out["observation"][0] and out["reward"].squeeze(-1).tolist() == [0.0, 1.0]


def _rows():
    return [
        {"id": "train_0", "question": "what is the capital of mongolia?", "golden_answers": ["Ulaanbaatar", "Ulan Bator"],
         "data_source": "nq"},
        {"id": "train_1", "question": "Who invented the airplane?", "golden_answers": "Wright brothers",
         "data_source": "hotpotqa"},
        {"question": "In which city is the Eiffel Tower?", "data_source": "triviaqa",
         "reward_model": {"ground_truth": {"target": ["Paris"]}}},
        {"question": "", "golden_answers": ["x"], "data_source": "nq"},  # skipped: no question
        {"question": "unanswerable?", "golden_answers": [], "data_source": "nq"},  # skipped: no answers
    ]


def _parquet_rows():
    """Search-R1's parquet layout: list answers, and the prompt/reward_model columns beside them."""
    rows = [dict(r) for r in _rows()[:2]]
    rows[1]["golden_answers"] = [rows[1]["golden_answers"]]
    for r in rows:
        r["reward_model"] = {"ground_truth": {"target": r["golden_answers"]}, "style": "rule"}
    return rows


def test_searchr1_jsonl_and_parquet(tmp_path):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    parquet = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(_parquet_rows()), parquet)
    questions = load_searchr1_questions(jsonl)
    assert [q.source for q in questions] == ["nq", "hotpotqa", "triviaqa"]
    assert questions[0].answers == ("Ulaanbaatar", "Ulan Bator") and questions[1].answers == ("Wright brothers",)
    assert questions[2].answers == ("Paris",) and questions[0].id == "train_0"
    assert [q.question for q in load_searchr1_questions(parquet)] == [q.question for q in questions[:2]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "golden_answers": ["a"]}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl: line 2 is not valid JSON"):
        load_searchr1_questions(bad)
    with pytest.raises(ValueError, match="no usable question"):
        (tmp_path / "empty.jsonl").write_text('{"question": ""}\n')
        load_searchr1_questions(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match=".csv"):
        (tmp_path / "x.csv").write_text("question\n")
        load_searchr1_questions(tmp_path / "x.csv")


def test_search_env_on_searchr1_files_reports_success_per_source(tmp_path, dense):
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    test = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(_parquet_rows()), test)
    env = SearchEnv(train_file=str(train), test_file=str(test), split="eval", num_groups=2, retriever=dense)
    td = env.reset()
    assert td["task"] == ["what is the capital of mongolia?", "Who invented the airplane?"]
    assert td["task_type"] == ["nq", "hotpotqa"]
    td["action"] = ["<answer>Ulan Bator</answer>", "<answer>Orville</answer>"]
    out = env.step(td)["next"]
    assert out["success"].squeeze(-1).tolist() == [True, False]
    metrics = _per_task_success(out, out["done"].reshape(-1))
    assert metrics == {"success/hotpotqa": 0.0, "success/nq": 1.0}
    train_env = SearchEnv(train_file=str(train), test_file=str(test), num_groups=1, retriever=dense)
    assert len(train_env.questions) == 3  # with a test file, the whole train file trains
    with pytest.raises(ValueError, match="either questions or train_file"):
        SearchEnv(train_file=str(train), questions=train_env.questions, retriever=dense)
