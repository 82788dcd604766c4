"""Top-k recall of the gold passage on the shipped Search questions: BM25 vs the dense retriever.

A question's gold passage is the Wikipedia summary of its evidence page (FanOutQA names it); recall@k
is the share of questions whose gold passage is among the top k retrieved. Both retrievers search
the same 10,033 summaries (``load_wiki_corpus``). The dense retriever embeds the corpus once (minutes
on 2 CPU cores) and caches the embeddings under ``$TORCHRL_AGENT_CACHE`` (``~/.cache/torchrl_agent``).

    python benchmarks/retrieval_recall.py [--subset solvable] [--k 3]

Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import time

from torchrl_agent.envs.search import BM25Retriever, DenseRetriever, load_fanoutqa_questions, load_wiki_corpus


def recall(retriever, questions, k: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    hits = retriever.search([q.question for q in questions], k)
    seconds = time.perf_counter() - t0
    found = sum(q.title in {p.title for p in passages} for q, passages in zip(questions, hits))
    return found / len(questions), len(questions) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subset", default="solvable", choices=["solvable", "in_corpus"])
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args()
    corpus = load_wiki_corpus("en-us")
    questions = load_fanoutqa_questions(args.subset)
    t0 = time.perf_counter()
    dense = DenseRetriever(corpus)
    dense_setup_s = time.perf_counter() - t0
    bm25 = BM25Retriever(corpus)
    out = {"questions": len(questions), "subset": args.subset, "passages": len(corpus), "k": args.k}
    for k in sorted({1, args.k, 10}):
        out[f"bm25_recall@{k}"], bm25_qps = recall(bm25, questions, k)
        out[f"dense_recall@{k}"], dense_qps = recall(dense, questions, k)
    out.update(bm25_queries_per_s=round(bm25_qps, 1), dense_queries_per_s=round(dense_qps, 1),
               dense_model=str(dense.model_path.name), dense_embeddings_from_cache=dense.loaded_from_cache,
               dense_setup_s=round(dense_setup_s, 1))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
