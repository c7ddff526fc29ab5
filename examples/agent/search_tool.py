"""A search tool over a small local corpus (agent.tools), ranked by BM25 (the bm25s package:
`pip install bm25s`, in the `agent` and `test` extras).

    agent:
      tools:
        - path: examples/agent/search_tool.py
          name: CorpusSearch
          kwargs: {top_k: 3}

The corpus is JSON Lines with "title" and "text" per document: by default
examples/agent/data/corpus.jsonl, 32 short articles about the Veltar Islands, a made-up place,
so that a model can only answer examples/agent/data/search_questions.jsonl by searching. The
index is built once per sandbox worker, when the class is constructed.
"""
from __future__ import annotations

import json
import os

import bm25s

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CORPUS = os.path.join(_HERE, "data", "corpus.jsonl")


class CorpusSearch:
    def __init__(self, corpus: str = DEFAULT_CORPUS, top_k: int = 3):
        if top_k < 1:
            raise ValueError(f"top_k={top_k}: at least 1")
        with open(corpus) as f:
            self.docs = [json.loads(line) for line in f if line.strip()]
        if not self.docs:
            raise ValueError(f"{corpus}: no documents")
        self.top_k = min(top_k, len(self.docs))
        self.retriever = bm25s.BM25()
        self.retriever.index(self._tokens([f"{d['title']}. {d['text']}" for d in self.docs]),
                             show_progress=False)

    def __call__(self, query: str) -> str:
        """Search the encyclopedia and return the best-matching articles.

        Args:
            query: a few keywords, e.g. "Mount Selk eruption"
        """
        found = self.retriever.retrieve(self._tokens([query]), k=self.top_k, show_progress=False)
        hits = [(int(i), float(s)) for i, s in zip(found.documents[0], found.scores[0]) if s > 0]
        if not hits:
            return f"No article matches {query!r}. Try other keywords."
        return "\n\n".join(f"[{self.docs[i]['title']}] {self.docs[i]['text']}" for i, _ in hits)

    @staticmethod
    def _tokens(texts: list[str]):
        return bm25s.tokenize(texts, stopwords="en", show_progress=False)
