"""Search-R1 (Jin et al., 2025): a retriever server, the `<search>`/`<answer>` env, EM reward, data.

    agentrl retriever --make-synthetic runs/search_r1/data          # offline corpus + QA pairs
    agentrl retriever --corpus runs/search_r1/data/corpus.jsonl --port 8000
    agentrl run --config recipes/search_r1.yaml

Heavy or optional dependencies (bm25s, faiss, sentence-transformers, pyarrow) are imported
inside the functions that need them, so importing the env stays cheap.
"""
