"""The Search environment: real Wikipedia summaries, real FanOutQA questions, real BM25 and HTTP retrieval."""

from __future__ import annotations

import json
import pickle
import threading
import urllib.request

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.envs.utils import check_env_specs

from torchrl_agent.envs import make_env
from torchrl_agent.envs.search import (
    INVALID_ACTION_MESSAGE,
    MAX_ACTION_CHARS,
    BM25Retriever,
    HttpRetriever,
    SearchEnv,
    SearchQuestion,
    exact_match,
    format_passages,
    load_fanoutqa_questions,
    load_wiki_corpus,
    make_retrieval_server,
    normalize_answer,
    parse_action,
    split_questions,
)
from torchrl_agent.envs.search.env import _default_bm25


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("torchrl_agent_cache")


@pytest.fixture(scope="session")
def bm25(cache_dir):
    """BM25 over the full en-us summary corpus, built once per session into a temporary cache."""
    retriever = BM25Retriever(cache_dir=cache_dir)
    assert not retriever.loaded_from_cache
    return retriever


@pytest.fixture(scope="session")
def server_url(bm25):
    """A real Search-R1-protocol server on 127.0.0.1 serving ``bm25``, stopped after the session."""
    server = make_retrieval_server(bm25, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)
    assert not thread.is_alive()


def _question(text: str) -> SearchQuestion:
    (q,) = [q for q in load_fanoutqa_questions() if q.question == text]
    return q


def _step(env, actions):
    td = TensorDict({"action": list(actions)}, batch_size=env.batch_size)
    return env.step(td)["next"]


# ----------------------------------------------------------------------------------- data
def test_corpus_and_questions_are_real_and_consistent():
    corpus = load_wiki_corpus()
    assert len(corpus) > 9000
    titles = {p.title for p in corpus.passages}
    assert "Mount Everest" in titles
    assert "Everest" in next(p.text for p in corpus.passages if p.title == "Mount Everest")

    solvable, in_corpus, every = (load_fanoutqa_questions(s) for s in ("solvable", "in_corpus", "all"))
    assert 50 < len(solvable) < len(in_corpus) < len(every)
    texts = {p.title: normalize_answer(p.text) for p in corpus.passages}
    for q in solvable:  # the gold answer is written in the evidence page's summary
        assert q.title in titles
        assert any(f" {normalize_answer(a)} " in f" {texts[q.title]} " for a in q.answers), q
    assert all(q.title in titles for q in in_corpus)
    assert len({normalize_answer(q.question) for q in every}) == len(every)  # merged duplicates
    assert set(_question("What is the height of Mount Everest?").answers) == {"8,848.86 m", "8848.86"}

    train, evaluation = split_questions(solvable, "train"), split_questions(solvable, "eval")
    assert len(train) + len(evaluation) == len(solvable) and len(evaluation) >= 10 and len(train) >= 40
    assert not {q.question for q in train} & {q.question for q in evaluation}
    assert not {q.title for q in train} & {q.title for q in evaluation}  # one page, one split


def test_normalisation_and_action_parsing():
    assert normalize_answer("  The  Beatles!") == "beatles"
    assert normalize_answer("8,848.86 m") == "884886 m"
    assert exact_match("washington d.c", ["Washington, D.C."])
    assert not exact_match("Washington", ["Washington, D.C."])
    assert parse_action("<search> capital of France </search>") == ("search", "capital of France")
    assert parse_action("I think. <ANSWER>Paris</ANSWER> <search>x</search>") == ("answer", "Paris")
    for bad in ["", "Paris", "<search></search>", "<answer> \n </answer>", "<search>a</answer>",
                "<search>a\x00</search>", "<answer>" + "a" * MAX_ACTION_CHARS + "</answer>", None, 3]:
        assert parse_action(bad)[0] == "invalid", bad


# ----------------------------------------------------------------------------------- retrieval
def test_bm25_finds_pages_from_their_titles(bm25):
    corpus = bm25.corpus
    rng = np.random.default_rng(0)
    titles = [corpus.passages[i].title for i in rng.choice(len(corpus), 50, replace=False)]
    results = bm25.search(titles, 3)
    assert len(results) == 50 and all(len(r) <= 3 for r in results)
    found = sum(t in [p.title for p in r] for t, r in zip(titles, results))
    assert found >= 45, found  # measured 193/200 on a larger sample
    (everest,) = bm25.search(["Mount Everest highest mountain"], 1)
    assert everest[0].title == "Mount Everest" and everest[0].score > 0
    assert "Everest" in everest[0].text
    # no known word: no passage (rather than arbitrary zero-score ones)
    assert bm25.search(["", "the of and", "qqxqzzv"], 3) == [[], [], []]
    with pytest.raises(ValueError, match="k must be"):
        bm25.search(["x"], 0)
    with pytest.raises(TypeError, match="queries"):
        bm25.search("Mount Everest", 3)


def test_bm25_index_is_cached_on_disk(bm25, cache_dir, monkeypatch):
    assert bm25.index_path.is_relative_to(cache_dir) and bm25.corpus.version in bm25.index_path.name
    again = BM25Retriever(cache_dir=cache_dir)
    assert again.loaded_from_cache
    queries = ["capital of Mongolia", "When was Actinium discovered?", "Who invented the airplane?"]
    assert again.search(queries, 3) == bm25.search(queries, 3)
    assert pickle.loads(pickle.dumps(bm25)).search(queries, 3) == bm25.search(queries, 3)  # for worker processes
    # the env's default retriever reads the cache named by $TORCHRL_AGENT_CACHE (else ~/.cache/torchrl_agent)
    monkeypatch.setenv("TORCHRL_AGENT_CACHE", str(cache_dir))
    _default_bm25.cache_clear()
    try:
        env = make_env("search")
        assert env.retriever.loaded_from_cache and env.retriever.index_path == bm25.index_path
        assert make_env("search", retriever="bm25").retriever is env.retriever  # one index per process
    finally:
        _default_bm25.cache_clear()


def test_http_retriever_matches_bm25(bm25, server_url):
    queries = ["capital of Mongolia", "Who invented the airplane?", "qqxqzzv", "Eiffel Tower architect"]
    remote = HttpRetriever(server_url).search(queries, 3)
    local = bm25.search(queries, 3)
    assert remote == local  # titles, texts and scores (JSON round-trips Python floats exactly)
    assert [len(r) for r in local] == [3, 3, 0, 3]
    # the raw wire format is Search-R1's
    body = json.dumps({"queries": ["capital of Mongolia"], "topk": 2, "return_scores": True}).encode()
    request = urllib.request.Request(server_url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        payload = json.loads(response.read())
    (hits,) = payload["result"]
    assert len(hits) == 2 and set(hits[0]) == {"document", "score"}
    assert hits[0]["document"]["contents"] == f"{local[0][0].title}\n{local[0][0].text}"
    # a URL without a path is completed; a bad one is refused; a dead server is a clear error
    assert HttpRetriever(server_url.rsplit("/", 1)[0]).search(queries[:1], 3) == remote[:1]
    with pytest.raises(ValueError, match="url"):
        HttpRetriever("127.0.0.1:8000")
    with pytest.raises(RuntimeError, match="retrieval server"):
        HttpRetriever("http://127.0.0.1:9/retrieve", timeout=2).search(["x"], 3)
    with pytest.raises(RuntimeError, match="404"):
        HttpRetriever(server_url.replace("/retrieve", "/search")).search(["x"], 3)


# ----------------------------------------------------------------------------------- env
def test_check_env_specs_and_group_seeding(bm25):
    env = make_env("search", num_groups=3, group_size=2, seed=0, retriever=bm25)
    check_env_specs(env)
    td = env.reset()
    obs, tasks = td["observation"], td["task"]
    for g in range(3):
        assert obs[2 * g] == obs[2 * g + 1] and tasks[2 * g] == tasks[2 * g + 1]
        assert obs[2 * g] == f"Question: {tasks[2 * g]}"
    assert td["expert_action"] == [""] * 6 and td["admissible_actions"] == [""] * 6
    train_questions = {q.question for q in env.questions}
    starts = set()
    for _ in range(8):
        starts.update(env.reset()["task"])
    assert starts <= train_questions and len(starts) > 3
    evaluation = make_env("search", num_groups=2, group_size=1, split="eval", retriever=bm25)
    eval_tasks = evaluation.reset()["task"]
    assert eval_tasks == [q.question for q in evaluation.questions[:2]]  # the panel walks the eval questions
    assert not set(eval_tasks) & train_questions


def test_garbage_actions_are_invalid_not_fatal(bm25):
    garbage = ["", "Paris", "x" * 20_000, "<search>\x00\x07</search>", "<answer></answer>", "\ud800\udfff"]  # surrogates arrive cleaned to "?"
    env = SearchEnv(num_groups=1, group_size=len(garbage), retriever=bm25)
    env.reset()
    out = _step(env, garbage)
    assert out["observation"] == [INVALID_ACTION_MESSAGE] * len(garbage)
    assert out["reward"].eq(0).all() and not out["done"].any() and not out["success"].any()
    assert out["step_count"].squeeze(-1).tolist() == [1] * len(garbage)


def test_search_then_answer_rewards(bm25):
    mongolia = _question("What is the capital of Mongolia?")
    everest = _question("What is the height of Mount Everest?")
    env = SearchEnv(num_groups=1, group_size=5, questions=[mongolia], retriever=bm25)
    td = env.reset()
    assert td["task"] == [mongolia.question] * 5
    out = _step(env, ["<search>capital of Mongolia</search>"] * 5)
    expected = format_passages(bm25.search(["capital of Mongolia"], 3)[0])
    assert out["observation"] == [expected] * 5
    assert expected.startswith("<information>Doc 1(Title: ") and "Ulaanbaatar" in expected
    assert expected.count("(Title: ") == 3
    assert out["reward"].eq(0).all() and not out["done"].any()
    answers = ["<answer>Ulaanbaatar</answer>", "<answer> the ULAANBAATAR. </answer>", "<answer>Beijing</answer>",
               "<answer>Ulaanbaatar city</answer>", "no tags"]
    out = _step(env, answers)
    assert out["reward"].squeeze(-1).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert out["success"].squeeze(-1).tolist() == [True, True, False, False, False]
    assert out["terminated"].squeeze(-1).tolist() == [True, True, True, True, False]
    assert not out["truncated"].any()
    # both gold forms of a merged question are accepted
    env = SearchEnv(num_groups=1, group_size=3, questions=[everest], retriever=bm25)
    env.reset()
    out = _step(env, ["<answer>8,848.86 m</answer>", "<answer>8848.86</answer>", "<answer>8849 m</answer>"])
    assert out["reward"].squeeze(-1).tolist() == [1.0, 1.0, 0.0]


def test_four_turn_limit(bm25):
    env = SearchEnv(num_groups=1, group_size=2, retriever=bm25)
    env.reset()
    for turn in range(1, 5):
        out = _step(env, ["<search>Mount Everest</search>", "nonsense"])
        assert out["step_count"].squeeze(-1).tolist() == [turn, turn]
        assert out["truncated"].all() == (turn == 4) and not out["terminated"].any()
    assert out["done"].all() and not env.running.any()
    out = _step(env, ["<answer>x</answer>", "<answer>x</answer>"])  # finished games ignore actions
    assert out["reward"].eq(0).all() and out["step_count"].squeeze(-1).tolist() == [4, 4]


def test_env_over_http_matches_bm25(bm25, server_url):
    question = _question("Who invented the airplane?")
    observations = []
    for retriever in (bm25, server_url):
        env = make_env("search", num_groups=1, group_size=2, retriever=retriever, questions=[question])
        env.reset()
        out = _step(env, ["<search>Who invented the airplane?</search>", "<search>Wright Flyer</search>"])
        observations.append(out["observation"])
    assert observations[0] == observations[1]
    assert "Title: Airplane" in observations[0][0] and observations[0][1].startswith("<information>Doc 1(Title: Wright brothers)")


def test_bad_arguments_are_named(bm25):
    with pytest.raises(ValueError, match="subset"):
        SearchEnv(subset="bogus", retriever=bm25)
    with pytest.raises(ValueError, match="retriever"):
        SearchEnv(retriever="elasticsearch")
    with pytest.raises(ValueError, match="top_k"):
        SearchEnv(top_k=0, retriever=bm25)
    with pytest.raises(TypeError, match="questions"):
        SearchEnv(questions=["What?"], retriever=bm25)
    with pytest.raises(ValueError, match="no questions"):
        SearchEnv(questions=[], retriever=bm25)
    assert torch.equal(SearchEnv(retriever=bm25, seed=3).reset()["step_count"], torch.zeros(1, 1, dtype=torch.int64))
